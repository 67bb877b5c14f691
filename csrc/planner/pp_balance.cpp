// Strategies for pipelines of HDP units (pipeline.h): PP-Balance and Megatron's lockstep slots.
//
// Under 1F1B a pipeline whose micro-batches cost c_1 .. c_n per stage takes about
// sum(c) + (P - 1) max(c): the largest micro-batch's forward and backward cross every stage on the
// critical path (the bubble). A DP bubble is magnified the same way. PP-Balance (the paper's
// Alg. 2 / Fig. 12) therefore keeps every pipeline to one length level and gives the pipelines of
// cheaper micro-batches more of them, so that all pipelines end together:
//   1. rings: sequences above the capacity (at least their memory minimum of units), and sequences
//      whose own chain P x T(s) would exceed the horizon, on the fewest units whose chain fits it;
//      each on the d pipelines that finish earliest with it (the estimate load + c + (P-1) cmax
//      keeps rings together: a pipeline that already carries a larger ring pays no new bubble).
//      A ring sits at the same slot on all its members (its members' rings are numbered from the
//      start of a common "ring region"; a member with fewer rings before it gets a hole there,
//      filled with one of its own largest local micro-batches, else left empty);
//   2. local sequences packed best-fit decreasing into capacity-sized micro-batches, sorted by
//      cost (their length level), then cut into contiguous runs, one per pipeline, pipelines
//      carrying rings first (their bubble is paid already): the smallest target tau (bisection)
//      at which every pipeline's estimate sum(c) + (P-1) max(c) stays within tau;
//   3. order: each pipeline (or each cohort of pipelines joined by rings, together) takes the
//      best of a few orders by the exact pipeline replay: rings first then locals by decreasing
//      cost; the cheapest locals first (ascending), the rings, then the rest decreasing; for
//      pipelines without rings also ascending and the organ-pipe order (cheap ends, costly middle);
//   4. balance: while it shortens the later of the two, a local micro-batch moves from the
//      pipeline that ends last to one that ends first (re-ordered, replayed), within a work bound
//      (kBalanceReplays below: bounded, deterministic work; a trial order whose moved-to or
//      moved-from pipeline alone, its rings as if local, already ends too late is not replayed:
//      waiting for ring partners only delays).
// The horizon is the pipelined lower bound times a few factors; each factor, each micro-batch size
// (capacity-sized bins, and bins of capacity / 2, / 4, / 8: a smaller bubble, (P-1) x the costliest
// micro-batch, against more per-micro-batch overhead), runs or greedy assignment, and ring widths
// (the fewest units within the horizon, or at least as many as keep a ring no costlier than a bin,
// so no ring magnifies its pipelines' bubble) gives a complete plan; the shortest replayed step
// wins; a layout equal to an earlier one (another horizon often changes no ring and no bin) is not
// ordered and balanced again. Safety nets: lockstep slots here, DP-Balance per pipeline in
// makePlan (strategies.cpp), each kept (and named) when it replays shorter.
//
// pp-lockstep (Megatron-LM's dynamic CP with PP, its development branch): every pipeline runs the
// same slots. Rings (memory minimum of units, any integer, as naive) and capacity-sized local
// micro-batches, costliest first, fill slot after slot: an item takes the first slot with enough
// free pipelines, on the free pipelines with the least load. No level grouping, no reordering.
//
// Both plan uniform pipelines (speed and memory multipliers are refused: a pipeline's stages are
// not one device).
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <set>
#include <utility>
#include <vector>

#include "planner/pp_balance.h"

namespace bytescale {
namespace planner {
namespace detail {

namespace {

thread_local PPBalanceWork g_work;  // the calling thread's current / last planPPBalance

}  // namespace

namespace ppb {

Plan PPBalance::run() {
  const double lb = pipelineBound(flat_, ctx_).value();
  static const double kFactors[] = {1.0, 1.05, 1.12, 1.25, 1.5, 2.0, 3.0};
  // Micro-batch sizes: capacity-sized bins have the least per-micro-batch overhead, smaller ones
  // the smallest bubble ((P-1) x the costliest micro-batch) and more pieces to balance with.
  std::vector<int64_t> caps{ctx_.cap_min};
  if (P_ > 1)
    for (int64_t c = ctx_.cap_min / 2; c >= 1 && caps.size() < 4; c /= 2) caps.push_back(c);
  bool any_ring = false;  // a sequence above the capacity, or a horizon short enough to shard one
  for (int64_t i : ctx_.order) any_ring |= ctx_.len[i] > ctx_.cap_max;
  Layout best, cur;
  bool have = false;
  double prev_best = -1;
  int stale = 0;
  for (double f : kFactors) {
    const double T = lb * f;
    for (size_t ci = 0; ci < caps.size(); ++ci) {
      const double before_cap = have ? best.step : -1;
      for (int mode = 0; mode < 4; ++mode) {
        const bool runs = mode % 2 == 0, uniform = mode >= 2;
        if (uniform && !any_ring) continue;
        if (!pass(T, runs, caps[ci], uniform, cur)) continue;
#ifdef PPB_DEBUG
        dump(runs ? "runs" : "lpt", T, cur);
#endif
        if (!have || cur.step < best.step * (1 - 1e-12)) {
          std::swap(best, cur);
          have = true;
          best_step_ = best.step;
        }
      }
      // halving the bins again only helps while the last halving did
      if (ci > 0 && !(best.step < before_cap * (1 - 1e-9))) break;
    }
    if (best.step <= T * (1 + 2e-3)) break;  // a plan meets this horizon: longer ones only loosen it
    // looser horizons stop once two in a row improve nothing
    stale = prev_best >= 0 && !(best.step < prev_best * (1 - 1e-9)) ? stale + 1 : 0;
    prev_best = best.step;
    if (stale >= 2) break;
  }
  // Safety net: Megatron's lockstep slots are a candidate too (kept when their replayed step is
  // shorter), so pp-balance is never worse than pp-lockstep.
  // With offloading allowed, the slots of rings that do not offload are tried as well (Eq. 3's
  // fewest units make a ring's micro-batch, and so its pipelines' bubble, large).
  for (bool no_offload : {false, true}) {
    if (best.step <= lb * (1 + 1e-9) || (no_offload && !ctx_.opt.offload)) continue;
    if (!lockstepLayout(ctx_, cur, no_offload)) continue;
    cur.finish.assign(H_, 0.0);
    std::vector<int> all(H_);
    std::iota(all.begin(), all.end(), 0);
    cur.step = evaluate(cur, all);
    if (cur.step < best.step) std::swap(best, cur);
  }
  return buildPlan(ctx_, flat_, best);
}

#ifdef PPB_DEBUG
void PPBalance::dump(const char* what, double T, const Layout& L) const {
  fprintf(stderr, "%s T=%.4f step=%.4f\n", what, T, L.step);
  for (int h = 0; h < H_; ++h) {
    fprintf(stderr, "  pipe %d fin %.4f:", h, L.finish[h]);
    for (const Entry& e : L.lists[h]) {
      if (e.ring >= 0) fprintf(stderr, " [%ld]R%d:%.3f", e.slot, e.ring, L.rings[e.ring].cost);
      else fprintf(stderr, " [%ld]%.3f", e.slot, L.bins[e.bin].cost);
    }
    fprintf(stderr, "\n");
  }
}
#endif

// One complete layout for horizon T. Returns false (L unfinished) when its assignment (rings,
// members, bins and their pipelines) equals an earlier pass's: ordering and balancing are a
// function of the assignment, so that pass's result is this one's and is already a candidate.
bool PPBalance::pass(double T, bool runs, int64_t bin_cap, bool uniform_rings, Layout& L) {
  ++work_.passes;
  std::vector<int64_t> locals;
  split(T, uniform_rings ? cm_.seqTime(static_cast<double>(std::min(bin_cap, ctx_.cap_min))) : 0.0, L, locals);
  std::vector<double> load(H_, 0.0), cmax(H_, 0.0);
  placeRings(L, load, cmax);
  packBins(ctx_, locals, L, bin_cap);
  assignBins(L, load, cmax, T, runs);
  if (!firstSeen(L)) {
    ++work_.passes_skipped;
    return false;
  }
  L.lists.assign(H_, {});
  L.finish.assign(H_, 0.0);
  std::vector<int> comp;
  std::vector<std::vector<int>> members;
  cohorts(L, comp, members);
  for (const auto& c : members) orderCohort(L, c);
  const double pre = *std::max_element(L.finish.begin(), L.finish.end());
  const bool large = kBalanceReplays * layoutOps(L) > kBalanceFloorOps;
  if (!(large && best_step_ > 0 && pre > best_step_ * (1 + kBalanceMargin))) balance(L, comp, members);
  L.step = *std::max_element(L.finish.begin(), L.finish.end());
  return true;
}

// Operations of one replay of the whole layout: micro-batches (a ring once per member) x stages.
int64_t PPBalance::layoutOps(const Layout& L) const {
  int64_t n = 0;
  for (int h = 0; h < H_; ++h) n += static_cast<int64_t>(L.lists[h].size());
  return n * P_;
}

// Records the assignment of L; false when an earlier pass had the same one.
bool PPBalance::firstSeen(const Layout& L) {
  std::vector<int64_t> key;
  for (const RingItem& r : L.rings) {
    key.insert(key.end(), {r.seq, r.d, r.slot});
    key.insert(key.end(), r.members.begin(), r.members.end());
  }
  key.push_back(-1);
  for (int h = 0; h < H_; ++h) {
    for (int32_t k : L.bins_of[h]) {
      const Bin& b = L.bins[k];
      key.insert(key.end(), L.seqs.begin() + b.off, L.seqs.begin() + b.end);
      key.push_back(-2);
    }
    key.push_back(-3);
  }
  return seen_.insert(std::move(key)).second;
}

}  // namespace ppb

Plan planPPBalance(const Context& ctx, const BoundParts& flat_bound) {
  ppb::requireUniform(ctx);
  g_work = PPBalanceWork();
  return ppb::PPBalance(ctx, flat_bound, g_work).run();
}

PPBalanceWork ppBalanceWork() { return g_work; }

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
