#include "comm/schedule.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace bytescale {
namespace comm {

namespace {
int mod(int a, int n) { return ((a % n) + n) % n; }
}  // namespace

RankMap::RankMap(std::vector<int> ranks, int world_size, int my_global_rank)
    : ranks_(std::move(ranks)), world_size_(world_size), my_index_(-1) {
  if (world_size < 1)
    throw std::invalid_argument("dynamic group: world size must be >= 1, got " +
                                std::to_string(world_size));
  if (ranks_.empty()) throw std::invalid_argument("dynamic group: the rank list is empty");
  if (static_cast<int>(ranks_.size()) > world_size)
    throw std::invalid_argument("dynamic group: " + std::to_string(ranks_.size()) +
                                " ranks given but the world has only " + std::to_string(world_size));
  index_of_.reserve(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i) {
    int r = ranks_[i];
    if (r < 0 || r >= world_size)
      throw std::invalid_argument("dynamic group: rank " + std::to_string(r) + " outside [0, " +
                                  std::to_string(world_size) + ")");
    index_of_.emplace_back(r, static_cast<int>(i));
  }
  std::sort(index_of_.begin(), index_of_.end());
  for (size_t i = 1; i < index_of_.size(); ++i)
    if (index_of_[i].first == index_of_[i - 1].first)
      throw std::invalid_argument("dynamic group: rank " + std::to_string(index_of_[i].first) +
                                  " appears twice in " + describe());
  my_index_ = groupRankOf(my_global_rank);
}

int RankMap::globalRank(int group_rank) const {
  if (group_rank < 0 || group_rank >= size())
    throw std::out_of_range("dynamic group " + describe() + ": group rank " +
                            std::to_string(group_rank) + " outside [0, " + std::to_string(size()) +
                            ")");
  return ranks_[group_rank];
}

int RankMap::groupRankOf(int global_rank) const {
  auto it = std::lower_bound(index_of_.begin(), index_of_.end(), std::make_pair(global_rank, -1));
  return it != index_of_.end() && it->first == global_rank ? it->second : -1;
}

int RankMap::next() const { return ranks_[mod(my_index_ + 1, size())]; }
int RankMap::prev() const { return ranks_[mod(my_index_ - 1, size())]; }

std::string RankMap::describe() const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks_.size(); ++i) os << (i ? ", " : "") << ranks_[i];
  os << "]";
  return os.str();
}

void RankMap::requireMember(const std::string& what) const {
  if (!isMember())
    throw std::runtime_error(what + ": this process is not a member of dynamic group " +
                             describe());
}

std::vector<RingStep> ringAllGatherSchedule(int n, int i) {
  std::vector<RingStep> steps;
  for (int s = 0; s + 1 < n; ++s) steps.push_back({mod(i - s, n), mod(i - s - 1, n)});
  return steps;
}

std::vector<RingStep> ringReduceScatterSchedule(int n, int i) {
  std::vector<RingStep> steps;
  for (int s = 0; s + 1 < n; ++s) steps.push_back({mod(i - s - 1, n), mod(i - s - 2, n)});
  return steps;
}

std::vector<PairStep> pairwiseSchedule(int n, int i) {
  std::vector<PairStep> steps;
  for (int s = 1; s < n; ++s) steps.push_back({mod(i + s, n), mod(i - s, n)});
  return steps;
}

int pipelineChunks(int64_t bytes, int64_t chunk_bytes) {
  if (chunk_bytes <= 0) chunk_bytes = 1;
  int64_t c = (bytes + chunk_bytes - 1) / chunk_bytes;
  if (c < 1) c = 1;
  if (c > 1024) c = 1024;
  return static_cast<int>(c);
}

}  // namespace comm
}  // namespace bytescale
