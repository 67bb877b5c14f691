// Internal to the planner: facts about the input and the builder of a flat Plan, shared by the
// strategies. The builder keeps flat tables (no per-micro-batch allocation): rings, local
// micro-batches, and the (rank, item) emission log whose per-rank order is the execution order.
#pragma once

#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

#include "planner/bound.h"
#include "planner/planner.h"

namespace bytescale {
namespace planner {
namespace detail {

inline double speedOf(const PlanOptions& opt, int r) {
  return opt.speed.empty() ? 1.0 : opt.speed[r];
}

// Offload ratio that lets a sequence of s tokens fit d ranks of capacity `cap` (0 if it fits
// without offloading). Assumes d >= the Eq. 3 minimum.
double ratioForRanks(const CostModel& m, int64_t s, int64_t cap, int d);

// Facts about the input every strategy needs.
struct Context {
  const PlanOptions& opt;
  const std::vector<int64_t>& len;
  int W;
  std::vector<int64_t> cap;   // per-rank token capacity
  std::vector<double> speed;  // per-rank speed
  int64_t cap_min, cap_max;
  double speed_sum, speed_max, speed_min;
  bool uniform;               // every rank has the same speed and capacity
  bool bounded;               // the peer budget binds (peer_budget.h): rings are intervals
  std::vector<int64_t> order; // sequence indices, longest first (ties: input position)
  Context(const std::vector<int64_t>& lengths, const PlanOptions& o);
  // Memory minimum of ranks (Eq. 3 when offloading) of a sequence at the smallest capacity.
  OffloadChoice memMin(int64_t s) const;
};

struct Builder {
  const Context& ctx;
  // rings: group grp_ranks[ring_grp[k] .. ring_grp[k+1]) (ascending = ring order), sequences
  // ring_seqs[ring_off[k] .. ring_off[k+1]) (one, except the static baseline's packed rings)
  std::vector<int64_t> ring_grp{0};
  std::vector<int32_t> grp_ranks;
  std::vector<int64_t> ring_off{0}, ring_seqs;
  std::vector<double> ring_cost, ring_ratio;
  // local micro-batches: sequences lmb_seqs[lmb_off[k] .. lmb_off[k+1])
  std::vector<int64_t> lmb_off{0}, lmb_seqs, lmb_tokens;
  std::vector<double> lmb_cost;
  // emission log: rank, item (ring id >= 0, or -(local micro-batch + 1)), ring position
  std::vector<int32_t> item_rank, item_pos;
  std::vector<int64_t> item;

  explicit Builder(const Context& c) : ctx(c) {}

  // Appends one ring micro-batch to every member (ring order = ascending rank; under a binding
  // peer budget the members must be an interval, ordered as peer_budget.h says) with the next
  // global ring id and the given per-rank cost: the n sequences `seqs`, each sharded zig-zag over
  // the members, in that order.
  void appendRing(const int64_t* seqs, size_t n, std::vector<int> members, double ratio, double cost);
  void appendRing(int64_t seq, std::vector<int> members, double ratio, double cost) {
    appendRing(&seq, 1, std::move(members), ratio, cost);
  }
  int64_t numRings() const { return static_cast<int64_t>(ring_off.size()) - 1; }
  // As appendRing, with the cost of the members' slowest rank.
  void addRing(int64_t seq, std::vector<int> members, double ratio);
  // Appends one local micro-batch holding `seqs` to rank r.
  void addLocal(int r, const int64_t* seqs, size_t n);
  // Appends whole sequences to rank r packed into capacity-sized local micro-batches (best fit
  // decreasing; `seqs` must be sorted longest first).
  void packLocal(int r, const int64_t* seqs, size_t n);
  // Flattens, replays (makespan, idle) and fills the statistics.
  Plan finish(const BoundParts& bound);
  // The replayed step without flattening, valid when every rank lists its rings before its
  // locals (the token-balanced strategies).
  double ringsFirstStep() const;
};

// naive / pow2 (strategies.cpp): rings first (memory minimum, rounded up to a power of two for
// pow2; or ring_sizes[seq] when given, indexed by sequence) on the ranks holding the fewest
// tokens, then capacity-sized bins of short sequences.
Builder tokenBalanced(const Context& ctx, Strategy strategy, const std::vector<int>* ring_sizes = nullptr);

// Offloading under the step's clock (offload_rule.cpp, see offload_rule.h): the plan of
// ctx.opt.strategy with ctx.opt.offload and OffloadRule::kStep.
Plan planStepClock(const Context& ctx, const BoundParts& bound);
bool insideStepClock();  // planStepClock runs a strategy on this thread (makePlan must not recurse)

// static (static_cp.cpp): the DP x CP baseline at CP degree `cp` (see planner.h).
Builder staticDpCp(const Context& ctx, int cp);

using LoadHeap = std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>,
                                     std::greater<std::pair<double, int>>>;

// The sync-aware balanced strategy (balanced.cpp).
Plan planBalanced(const Context& ctx, const BoundParts& bound);

// Small instances (balanced.cpp): when `incumbent` is more than kRefineTolerance above the bound
// and the instance is small (sequences x ranks <= kRefineCells), searches list schedules
// (listsched.h) from it on a fixed budget; returns the shorter of the two.
constexpr double kRefineTolerance = 0.005;
constexpr double kRefineCells = 65536;
constexpr size_t kRefineMixes = 1024;
constexpr int64_t kRefinePlacements = 20000;
constexpr int64_t kRefineMaxEvals = 4000;
constexpr int kRefineSearchSequences = 8;  // the branch and bound's instances: few sequences
constexpr int kRefineSearchRanks = 16;     // and ranks,
constexpr int64_t kRefineNodes = 5000;    // its node budget
Plan refineSmall(const Context& ctx, const BoundParts& bound, Plan incumbent);

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
