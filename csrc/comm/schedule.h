// Pure C++ (no torch): the rank map of a dynamic group and the step schedules of the P2P
// algorithms that run group collectives on the one global communicator. Kept torch-free so
// GoogleTest checks them without processes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace bytescale {
namespace comm {

// An ordered list of distinct global ranks. Order matters: it is the ring order, and group rank i
// is ranks[i]. Creating one is local and costs O(size).
class RankMap {
 public:
  // Throws std::invalid_argument naming the problem (empty, duplicate, out of [0, world)).
  RankMap(std::vector<int> ranks, int world_size, int my_global_rank);

  int size() const { return static_cast<int>(ranks_.size()); }
  int worldSize() const { return world_size_; }
  // Position of this process in the group, -1 if it is not a member.
  int myIndex() const { return my_index_; }
  bool isMember() const { return my_index_ >= 0; }
  int globalRank(int group_rank) const;   // throws for out-of-range group ranks
  int groupRankOf(int global_rank) const; // -1 if not a member
  // Ring neighbours of this process (global ranks). Only valid for members.
  int next() const;
  int prev() const;
  const std::vector<int>& ranks() const { return ranks_; }
  std::string describe() const;  // "[3, 0, 5]"
  // Throws std::runtime_error "<what>: rank R is not a member of dynamic group [..]" if needed.
  void requireMember(const std::string& what) const;

 private:
  std::vector<int> ranks_;
  // (global rank, group rank), sorted by global rank: O(group size) memory whatever the world's
  // size (a cached ring at 16,384 ranks costs its members, not the world), O(log n) lookups.
  std::vector<std::pair<int, int>> index_of_;
  int world_size_;
  int my_index_;
};

// Block j of n of a flat buffer of `total` elements: [j*total/n, (j+1)*total/n). Any total works;
// blocks differ by at most one element and may be empty.
inline int64_t blockStart(int64_t total, int n, int j) { return (total * j) / n; }

// One step of a ring algorithm at one ring position: which block it sends to its next neighbour
// and which block it receives from its previous neighbour.
struct RingStep {
  int send_block;
  int recv_block;
};

// Ring all-gather over n positions: n-1 steps; at step s position i sends block (i-s) mod n and
// receives block (i-s-1) mod n. Afterwards every position holds every block.
std::vector<RingStep> ringAllGatherSchedule(int n, int position);

// Ring reduce-scatter over n positions: n-1 steps; at step s position i sends its running partial
// of block (i-s-1) mod n and receives the partial of block (i-s-2) mod n, which it reduces with its
// own contribution. Afterwards position i holds block i reduced over all positions.
std::vector<RingStep> ringReduceScatterSchedule(int n, int position);

// Pairwise exchange (all-to-all) over n positions: step s in 1..n-1 sends to (i+s) mod n and
// receives from (i-s) mod n. Returns {send_to, recv_from} group ranks per step.
struct PairStep {
  int send_to;
  int recv_from;
};
std::vector<PairStep> pairwiseSchedule(int n, int position);

// Chunked pipeline broadcast along the ring starting at `root`: number of chunks for a message of
// `bytes` bytes (at least 1), so relays overlap receiving chunk c+1 with forwarding chunk c.
int pipelineChunks(int64_t bytes, int64_t chunk_bytes = 1 << 20);

}  // namespace comm
}  // namespace bytescale
