#include "planner/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

#include "planner/listsched.h"

namespace bytescale {
namespace planner {

namespace {

using detail::ListModel;
constexpr double kInf = std::numeric_limits<double>::infinity();

void validate(const std::vector<int64_t>& lengths, const PlanOptions& opt) {
  // makePlan's checks (bad input, a sequence the world cannot hold) with its messages.
  PlanOptions o = opt;
  o.strategy = Strategy::kNaive;
  (void)makePlan(lengths, o);
}

}  // namespace

ReferencePlan searchReference(const std::vector<int64_t>& lengths, const PlanOptions& opt,
                              int64_t evaluations, uint64_t seed, const Plan* start) {
  validate(lengths, opt);
  ListModel M(lengths, opt, size_t{1} << 20);
  std::mt19937_64 rng(seed);
  ReferencePlan out;
  std::vector<std::pair<std::vector<int>, std::vector<int>>> starts;
  starts.emplace_back(M.longestFirst(), std::vector<int>(M.n, -1));
  std::vector<int> order, mix;
  if (start && M.fromPlan(*start, order, mix)) starts.emplace_back(order, mix);
  const int64_t per = std::max<int64_t>(1, evaluations / static_cast<int64_t>(starts.size()));
  double best = kInf;
  std::vector<int> best_order, best_mix;
  for (auto& [o, m] : starts) {
    const double step = detail::lateAcceptance(M, o, m, detail::kNoHorizon, per, rng, out.work);
    if (step < best) {
      best = step;
      best_order = o;
      best_mix = m;
    }
  }
  out.plan = M.build(best_order, best_mix, detail::kNoHorizon, "search");
  return out;
}

ReferencePlan exactReference(const std::vector<int64_t>& lengths, const PlanOptions& opt,
                             int64_t node_limit) {
  if (lengths.size() > 10 || opt.world_size > 16)
    throw std::invalid_argument("exactReference: at most 10 sequences and 16 ranks, got " +
                                std::to_string(lengths.size()) + " and " +
                                std::to_string(opt.world_size));
  validate(lengths, opt);
  ListModel M(lengths, opt, size_t{1} << 16);
  // Incumbent: a short local search.
  std::mt19937_64 rng(1);
  std::vector<int> order = M.longestFirst(), mix(M.n, -1);
  int64_t used = 0;
  const double inc = detail::lateAcceptance(M, order, mix, detail::kNoHorizon, 2000, rng, used);
  M.fix(order, mix, detail::kNoHorizon);
  const detail::SearchResult r = detail::branchAndBound(M, inc * (1 + 1e-12), node_limit, order, mix);
  ReferencePlan out;
  out.plan = M.build(order, mix, detail::kNoHorizon, "exact");
  out.optimal = r.complete;
  out.work = r.nodes;
  return out;
}

}  // namespace planner
}  // namespace bytescale
