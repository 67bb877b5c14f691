// The HDP planner (pure C++, no torch): assigns one step's sequences to ranks.
//
// Output, per rank, an ordered list of micro-batches. A micro-batch is either
//   * a ring micro-batch: ONE sequence sharded over a dynamic group of D ranks (any integer D),
//     this rank holding zig-zag chunks (pos, 2D-1-pos) (csrc/attention/zigzag.h), with the
//     offload ratio its activations need; or
//   * a local micro-batch: whole sequences packed up to the rank's token capacity.
// Ring micro-batches come first on every rank, in one global order, so every member of a group
// reaches a group's micro-batch after the same earlier groups (no deadlock, similar arrival).
//
// Strategies:
//   naive    - the paper's Alg. 1: ranks per long sequence from memory (Eq. 3 with offloading),
//              short sequences best-fit into capacity-sized bins, everything balanced by TOKENS.
//   balanced - ours: balanced by predicted TIME (cost model): D(s) may grow beyond the memory
//              minimum when a sequence's per-rank time would exceed the step's target, long
//              sequences go to the least-loaded ranks, short ones by longest-processing-time
//              first onto the rank that finishes earliest (speed-aware), then packed per rank.
//   pow2     - a Megatron-style dynamic CP baseline: like naive but D rounded up to a power of 2.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/cost_model.h"

namespace bytescale {
namespace planner {

enum class Strategy { kNaive = 0, kBalanced = 1, kPow2 = 2 };
Strategy parseStrategy(const std::string& name);
std::string strategyName(Strategy s);

struct PlanOptions {
  int world_size = 1;
  int64_t capacity = 0;         // tokens per micro-batch per rank (before multipliers)
  std::vector<double> speed;    // per-rank relative speed (empty: all 1)
  std::vector<double> memory;   // per-rank capacity multiplier (empty: all 1)
  CostModel cost;
  bool offload = false;
  Strategy strategy = Strategy::kBalanced;
};

// Flat (structure-of-arrays) plan, cheap to serialise and to expose to Python without copies.
struct Plan {
  int world_size = 0;
  std::string strategy;
  // rank r's micro-batches are [rank_mb[r], rank_mb[r+1])
  std::vector<int64_t> rank_mb;
  // micro-batch m: segments [mb_seg[m], mb_seg[m+1]), group ranks [mb_grp[m], mb_grp[m+1])
  std::vector<int64_t> mb_seg;
  std::vector<int64_t> mb_grp;
  std::vector<double> mb_offload;  // offload ratio r of the micro-batch (0 = none)
  std::vector<double> mb_cost;     // predicted time on its rank (seconds)
  std::vector<int64_t> mb_tokens;  // tokens held by the rank in this micro-batch
  std::vector<int64_t> mb_ring;    // global order of ring micro-batches (-1: local)
  // segment k: sequence index (position in the input), ring size, ring position, tokens held
  std::vector<int64_t> seg_seq;
  std::vector<int32_t> seg_ring_size;
  std::vector<int32_t> seg_ring_pos;
  std::vector<int64_t> seg_tokens;
  std::vector<int32_t> grp_ranks;
  // predictions
  std::vector<double> rank_cost;
  double makespan = 0, mean_cost = 0, imbalance = 1, lower_bound = 0;
  int64_t num_sequences = 0;

  int64_t numMicroBatches() const { return static_cast<int64_t>(mb_tokens.size()); }

  std::vector<uint8_t> serialize() const;
  static Plan deserialize(const uint8_t* data, size_t size);

  // Checks every invariant against the input (every token once, capacities after offload,
  // consistent ring order, stats); throws std::logic_error describing the first violation.
  void verify(const std::vector<int64_t>& lengths, const PlanOptions& opt) const;
};

// Throws std::invalid_argument on bad input (naming the value) and when a sequence cannot be
// placed even using every rank.
Plan makePlan(const std::vector<int64_t>& lengths, const PlanOptions& opt);

// Per-rank token capacity after the memory multiplier (at least 1).
int64_t rankCapacity(const PlanOptions& opt, int rank);

}  // namespace planner
}  // namespace bytescale
