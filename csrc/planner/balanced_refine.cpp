// The balanced strategy's list-schedule refinement of small instances (builder.h: refineSmall):
// a search over list schedules (listsched.h) from the timeline plan, on fixed budgets.
#include <random>
#include <vector>

#include "planner/builder.h"
#include "planner/listsched.h"

namespace bytescale {
namespace planner {
namespace detail {

Plan refineSmall(const Context& ctx, const BoundParts& bound, Plan incumbent) {
  // Under a binding peer budget list schedules would pick any members: the timeline plan stays.
  if (ctx.bounded) return incumbent;
  const double lb = bound.value();
  const int W = ctx.W;
  const int n = static_cast<int>(ctx.len.size());
  if (W < 2 || n == 0 || incumbent.makespan <= lb * (1 + kRefineTolerance)) return incumbent;
  if (static_cast<double>(n) * W > kRefineCells || ListModel::mixCount(ctx.opt) > kRefineMixes)
    return incumbent;
  const ListModel M(ctx.len, ctx.opt, kRefineMixes);
  double best = incumbent.makespan * (1 - 1e-9), best_h = kNoHorizon;
  std::vector<int> best_order, best_mix;
  auto consider = [&](const std::vector<int>& order, const std::vector<int>& mix, double h) {
    const double step = M.step(order, mix, h);
    if (step < best) {
      best = step;
      best_order = order;
      best_mix = mix;
      best_h = h;
    }
    return step;
  };
  // 1. The incumbent rebuilt as a list schedule (never longer), then orders decoded with mixes
  //    chosen on the way: the least work ending by a horizon (a few from the bound up), or the
  //    mix ending first.
  std::vector<std::vector<int>> orders;
  {
    std::vector<int> order, mix;
    if (M.fromPlan(incumbent, order, mix)) {
      consider(order, mix, kNoHorizon);
      orders.push_back(order);
    }
  }
  orders.push_back(M.longestFirst());
  const std::vector<int> open(n, -1);
  for (const std::vector<int>& order : orders) {
    consider(order, open, kNoHorizon);
    // the least horizon whose schedule ends within it, bisected between the bound (tried
    // first) and the best step so far
    double lo = lb, hi = best;
    for (int it = 0; it < 10 && hi > lo * (1 + 1e-3); ++it) {
      const double h = it == 0 ? lo : 0.5 * (lo + hi);
      if (consider(order, open, h) <= h * (1 + 1e-9)) hi = h;
      else lo = h;
    }
  }
  if (best_order.empty()) {
    if (!M.fromPlan(incumbent, best_order, best_mix)) return incumbent;
    best_h = kNoHorizon;
  }
  // 2. Searches from the best of those, on fixed budgets (deterministic: every rank plans the
  //    same): a descent that re-inserts each sequence at every position with every mix; late-
  //    acceptance hill climbing from it, from it with the open mixes chosen by the earliest end,
  //    and from the longest-first order with every mix open, each polished by the descent; and,
  //    for a handful of sequences, the exhaustive branch and bound on a node budget.
  const int64_t evals = std::min<int64_t>(kRefineMaxEvals, kRefinePlacements / n);
  int64_t used = 0;
  auto keep = [&](std::vector<int>& order, std::vector<int>& mix, double h, double step) {
    if (step < best) {
      best = step;
      best_order = std::move(order);
      best_mix = std::move(mix);
      best_h = h;
    }
  };
  {
    std::vector<int> order = best_order, mix = best_mix;
    const double step = reinsertDescent(M, order, mix, best_h, evals / 2, used);
    keep(order, mix, best_h, step);
  }
  std::mt19937_64 rng(0x5eed);
  for (int run = 0; run < 3; ++run) {
    std::vector<int> order = best_order, mix = best_mix;
    const double h = run == 0 ? best_h : kNoHorizon;
    if (run == 1) M.fix(order, mix, best_h);  // the open mixes as the best schedule chose them
    if (run == 2) {
      order = M.longestFirst();
      mix = open;
    }
    double step = lateAcceptance(M, order, mix, h, evals / 6, rng, used);
    step = std::min(step, reinsertDescent(M, order, mix, h, evals / 6, used));
    keep(order, mix, h, step);
  }
  if (n <= kRefineSearchSequences && W <= kRefineSearchRanks) {
    std::vector<int> order = best_order, mix = best_mix;
    M.fix(order, mix, best_h);
    const SearchResult r = branchAndBound(M, best, kRefineNodes, order, mix);
    if (r.improved) keep(order, mix, best_h, r.step);
  }
  if (best_order.empty() || !(best < incumbent.makespan * (1 - 1e-9))) return incumbent;
  Plan p = M.build(best_order, best_mix, best_h, "balanced");
  return p.makespan < incumbent.makespan ? p : incumbent;
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
