// Internal to the planner: PP-Balance and pp-lockstep (pipeline.h), shared by their sources:
//   pp_balance.cpp  the search: horizons, micro-batch sizes and modes, one pass per layout, the
//                   lockstep safety net (the strategy's description is there);
//   pp_assign.cpp   level assignment and slot placement: rings, bins to pipelines, orders, cohorts;
//   pp_order.cpp    the replay-facing parts: a layout's pipelines replayed, the best order of a
//                   cohort, the balance step's moves;
//   pp_layout.cpp   packing into bins, Megatron's lockstep slots, a layout's plan.
#pragma once

#include <cstdint>
#include <limits>
#include <set>
#include <vector>

#include "planner/builder.h"
#include "planner/pipeline.h"

namespace bytescale {
namespace planner {
namespace detail {
namespace ppb {

// Work bounds of the balance step (4.), counted in operations replayed, never in time, so every
// rank plans the same batch to the same plan. A layout's balance stops once its replays of cohorts
// of several pipelines (rings join them; each trial replays the whole cohort, with 32 pipelines
// often all of them) have cost kBalanceReplays replays of the whole layout (its micro-batches x
// stages), or kBalanceFloorOps operations where that is more (checked before every trial);
// ring-free pipelines replay alone, cheaply, and stay bounded by the move count. Where the replay
// budget exceeds the floor (a large layout: above ~3K micro-batches x stages, e.g. 400
// micro-batches on 8 stages), a layout whose step before balancing is more than kBalanceMargin
// behind the best plan so far is not balanced. Smaller instances (the tests' and examples' sizes)
// are balanced as before the bounds: on the GoogleTests' and bench_pp.py's mixed batches (up to
// 120 sequences) every plan is unchanged; balancing there can gain more than 3% per layout, so
// the margin would cost them. On the benchmark's batches (700-1,100 sequences, 32 pipelines) the
// bounds leave every plan unchanged (benchmarks/RESULTS.md).
constexpr int64_t kBalanceReplays = 16;
constexpr int64_t kBalanceFloorOps = 50000;
constexpr double kBalanceMargin = 0.03;

struct RingItem {
  int64_t seq = 0;
  int d = 1;
  double cost = 0, ratio = 0;
  std::vector<int> members;  // ascending
  int64_t slot = 0;          // slot within the members' ring region
};

struct Bin {
  int64_t off = 0, end = 0;  // sequences seqs[off .. end), longest first
  int64_t tokens = 0;
  double cost = 0;
};

// An entry of a pipeline's list: a ring (index into rings) or a local bin, at a slot.
struct Entry {
  int32_t ring = -1, bin = -1;
  int64_t slot = 0;
};

// A complete assignment: rings, bins, and per pipeline its bins and ordered entries.
struct Layout {
  std::vector<RingItem> rings;
  std::vector<Bin> bins;
  std::vector<int64_t> seqs;
  std::vector<std::vector<int32_t>> ring_of;  // per pipeline: its rings (indices), in ring-slot order
  std::vector<std::vector<int32_t>> bins_of;  // per pipeline: its bins
  std::vector<std::vector<Entry>> lists;      // per pipeline, in slot order
  std::vector<double> finish;                 // per pipeline (replayed)
  double step = 0;
  bool lockstep = false;                      // built by lockstepLayout
};

// Throws std::invalid_argument for per-rank speed / memory multipliers (pipelines are uniform).
void requireUniform(const Context& ctx);
// Best-fit decreasing of `locals` (longest first) into bins of `bin_cap` tokens (0: the capacity; a
// sequence longer than bin_cap gets a bin of its own); L.bins costliest first.
void packBins(const Context& ctx, const std::vector<int64_t>& locals, Layout& L, int64_t bin_cap = 0);
// The Plan of a layout: items emitted slot by slot (ring ids in slot order), then the pipeline replay.
Plan buildPlan(const Context& ctx, const BoundParts& flat_bound, const Layout& L);
// Megatron's lockstep slots (pp_balance.cpp's file comment). no_offload: rings at the fewest units
// that hold them without offloading even when the options allow it (false when one needs more
// units than exist).
bool lockstepLayout(const Context& ctx, Layout& L, bool no_offload = false);

// PP-Balance on one input (pp_balance.cpp's file comment); `work` counts what it does.
class PPBalance {
 public:
  PPBalance(const Context& ctx, const BoundParts& flat, PPBalanceWork& work)
      : ctx_(ctx), cm_(ctx.opt.cost), po_(ctx.opt.pipeline), flat_(flat), P_(po_.stages), H_(ctx.W), work_(work) {}

  Plan run();

 private:
  const Context& ctx_;
  const CostModel& cm_;
  const PipelineOptions& po_;
  const BoundParts& flat_;
  const int P_, H_;
  PPBalanceWork& work_;

  double hops(double tokens) const { return P_ > 1 ? 2.0 * (P_ - 1) * po_.p2pTime(tokens) : 0.0; }
  // The estimate of a pipeline's step: load + (P-1) x (its costliest chain's stage time).
  double est(double load, double cmax) const { return load + (P_ - 1) * cmax; }
  double chain(double c, double tokens) const {
    return c + (P_ > 1 ? 2.0 * po_.p2pTime(tokens) : 0.0);
  }
#ifdef PPB_DEBUG
  void dump(const char* what, double T, const Layout& L) const;
#endif

  // the search (pp_balance.cpp)
  bool pass(double T, bool runs, int64_t bin_cap, bool uniform_rings, Layout& L);
  int64_t layoutOps(const Layout& L) const;
  bool firstSeen(const Layout& L);

  // 1.-3. level assignment and slot placement (pp_assign.cpp)
  void split(double T, double ring_target, Layout& L, std::vector<int64_t>& locals) const;
  void placeRings(Layout& L, std::vector<double>& load, std::vector<double>& cmax) const;
  bool fillRuns(const Layout& L, const std::vector<int>& order, const std::vector<double>& load0,
                const std::vector<double>& cmax0, double tau, std::vector<int>* owner) const;
  void assignBins(Layout& L, const std::vector<double>& load, const std::vector<double>& cmax,
                  double start, bool runs) const;
  void orderPipeline(Layout& L, int h, int64_t pre, int tail) const;
  void cohorts(const Layout& L, std::vector<int>& comp, std::vector<std::vector<int>>& members) const;

  // replays, orders of cohorts, 4. balance (pp_order.cpp); Scratch: evaluate's buffers, reused
  // between replays.
  struct Scratch {
    std::vector<int> local;
    std::vector<int64_t> ring_id, rank_mb, mb_ring, mb_slot, ring_grp;
    std::vector<int32_t> ring_by_id, grp;
    std::vector<double> f, b, p2p;
    PipelineReplay rep;
    ReplayScratch replay;
  };
  double evaluate(Layout& L, const std::vector<int>& pipes);
  static void clearOps(Scratch& w);
  void pushOp(Scratch& w, const Layout& L, const Entry& e, int h, int64_t ring) const;
  double alone(const Layout& L, int h);
  double orderCohort(Layout& L, const std::vector<int>& pipes,
                     double threshold = std::numeric_limits<double>::infinity(),
                     const std::vector<int>& changed = {});
  void balance(Layout& L, const std::vector<int>& comp, const std::vector<std::vector<int>>& members);

  Scratch scratch_;
  std::vector<std::vector<Entry>> best_lists_;  // orderCohort's scratch
  std::vector<double> best_finish_;
  std::set<std::vector<int64_t>> seen_;  // assignments of the passes so far
  double best_step_ = -1;    // of the best layout so far (pass() reads it)
  int64_t cohort_ops_ = 0;   // operations replayed in replays of cohorts of several pipelines
};

}  // namespace ppb
}  // namespace detail
}  // namespace planner
}  // namespace bytescale
