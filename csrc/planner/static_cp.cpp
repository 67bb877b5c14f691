// The static DP x CP baseline as a planner strategy (planner.h, "static"): what Megatron-LM /
// TransformerEngine style context parallelism does with one CP degree for the whole run.
//
//   * CP degree cp: PlanOptions::static_cp, or the smallest power of two with cp x capacity >=
//     the longest sequence (staticCpDegree); world / cp replicas, replica q on the consecutive
//     ranks q*cp .. q*cp + cp - 1 (its CP group, in ring order);
//   * sequences, longest first (ties: batch position), packed first-fit into bins of cp x capacity
//     tokens (capacity: the smallest rank capacity, a static mesh being sized for its weakest rank);
//   * bin b goes to replica b mod (world / cp), each replica running its bins in that order: at
//     cp > 1 a bin is one ring micro-batch on every rank of the replica (every sequence of the bin
//     sharded zig-zag over the CP group), at cp = 1 a local micro-batch.
// The micro-batch cost is the sum of the sequences' shardedTime(s, cp) (seqTime at cp = 1) on the
// replica's slowest rank, as the other strategies price a local pack.
#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "planner/builder.h"

namespace bytescale {
namespace planner {

int staticCpDegree(int64_t longest, int64_t capacity, int world_size) {
  if (capacity < 1)
    throw std::invalid_argument("static CP degree: capacity must be >= 1 token, got " +
                                std::to_string(capacity));
  if (world_size < 1)
    throw std::invalid_argument("static CP degree: world_size must be >= 1, got " +
                                std::to_string(world_size));
  int64_t cp = 1;
  while (cp * capacity < longest) cp *= 2;
  if (cp > world_size) {
    std::ostringstream os;
    os << "static CP baseline: the longest sequence (" << longest << " tokens) needs CP degree " << cp
       << " at capacity " << capacity << ", more than the world size " << world_size;
    throw std::invalid_argument(os.str());
  }
  return static_cast<int>(cp);
}

namespace detail {

namespace {

// First fit over bins of equal size in O(log n) per item: a max-tree over every bin's room, the
// bins not yet opened being empty (room = bin size). The leftmost bin with room >= s is the one a
// linear first-fit scan over the opened bins picks, or else the next bin to open.
class FirstFit {
 public:
  FirstFit(size_t n, int64_t bin) : size_(1) {
    while (size_ < std::max<size_t>(n, 1)) size_ *= 2;
    room_.assign(2 * size_, bin);
  }
  // The bin that takes an item of s tokens (s <= bin size); updates its room.
  size_t place(int64_t s) {
    size_t i = 1;
    while (i < size_) i = room_[2 * i] >= s ? 2 * i : 2 * i + 1;
    const size_t leaf = i - size_;
    room_[i] -= s;
    for (i /= 2; i >= 1; i /= 2) room_[i] = std::max(room_[2 * i], room_[2 * i + 1]);
    return leaf;
  }

 private:
  size_t size_;
  std::vector<int64_t> room_;
};

}  // namespace

Builder staticDpCp(const Context& ctx, int cp) {
  const PlanOptions& opt = ctx.opt;
  const int W = ctx.W;
  if (cp < 1 || cp > W || W % cp != 0) {
    std::ostringstream os;
    os << "static CP baseline: CP degree " << cp << " does not divide world size " << W
       << " (the baseline needs world_size = DP x CP; give a static_cp that divides it)";
    throw std::invalid_argument(os.str());
  }
  const int64_t bin_cap = static_cast<int64_t>(cp) * ctx.cap_min;
  for (int64_t i : ctx.order) {
    if (ctx.len[i] <= bin_cap) break;
    std::ostringstream os;
    os << "static CP baseline: sequence " << i << " of " << ctx.len[i] << " tokens does not fit CP degree "
       << cp << " at capacity " << ctx.cap_min << " (" << bin_cap
       << " tokens per CP group); raise the CP degree or leave it to be sized for the longest sequence";
    throw std::invalid_argument(os.str());
  }
  // First fit decreasing; bins numbered in the order they were opened.
  const size_t n = ctx.order.size();
  FirstFit ff(n, bin_cap);
  std::vector<size_t> bin_of(n);
  size_t bins = 0;
  for (size_t k = 0; k < n; ++k) {
    bin_of[k] = ff.place(ctx.len[ctx.order[k]]);
    bins = std::max(bins, bin_of[k] + 1);
  }
  std::vector<int64_t> off(bins + 1, 0), seqs(n);
  for (size_t k = 0; k < n; ++k) ++off[bin_of[k] + 1];
  for (size_t b = 0; b < bins; ++b) off[b + 1] += off[b];
  {
    std::vector<int64_t> at(off.begin(), off.end() - 1);
    for (size_t k = 0; k < n; ++k) seqs[at[bin_of[k]]++] = ctx.order[k];  // longest first per bin
  }
  Builder b(ctx);
  const int replicas = W / cp;
  std::vector<int> members(cp);
  for (size_t bin = 0; bin < bins; ++bin) {
    const int q = static_cast<int>(bin % static_cast<size_t>(replicas));
    const int64_t* s = seqs.data() + off[bin];
    const size_t m = static_cast<size_t>(off[bin + 1] - off[bin]);
    if (cp == 1) {
      b.addLocal(q, s, m);
      continue;
    }
    double min_speed = 1e300;
    for (int k = 0; k < cp; ++k) {
      members[k] = q * cp + k;
      min_speed = std::min(min_speed, ctx.speed[q * cp + k]);
    }
    double cost = 0;
    for (size_t j = 0; j < m; ++j) cost += opt.cost.shardedTime(static_cast<double>(ctx.len[s[j]]), cp);
    b.appendRing(s, m, members, 0.0, cost / min_speed);
  }
  return b;
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
