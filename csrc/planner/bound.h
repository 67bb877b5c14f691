// Ring sizes by cost and the planner's lower bound (pure C++, no torch).
//
// Per-rank time of a sequence of s tokens on a ring of d ranks, T(d) = CostModel::shardedTime(s, d),
// is (a1 s^2 + b1 s)/d + g per layer while the ring's communication hides under attention, then
// b1 s/d + g + comm(d) once it is exposed (comm grows with d). Exposure starts at one d (the
// "crossing"), so T decreases up to the crossing and is convex after it: the best d over a range
// is among a handful of candidates, found in O(log W) without scanning every d.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/cost_model.h"

namespace bytescale {
namespace planner {

struct PlanOptions;

// The ring sizes of one sequence over [lo, hi] (1 <= lo <= hi).
struct RingShape {
  int lo = 1, hi = 1;
  int crossing = 1;  // first d in [lo, hi + 1] whose communication is exposed (hi + 1: none)
  int best = 1;      // argmin of T over [lo, hi] (smallest on ties)
};

// Whether a ring of d ranks leaves communication exposed for a sequence of s tokens.
bool commExposed(const CostModel& m, double s, int d);

RingShape ringShape(const CostModel& m, double s, int lo, int hi);

// The smallest d in [shape.lo, shape.best] with T(d) <= budget, or -1 if even T(best) > budget.
int minRanksWithin(const CostModel& m, double s, const RingShape& shape, double budget);

// The bound no assignment can beat under the cost model and the replay's model of a step:
//   max(work, piece, waves)
//   work:  total work / total speed, a sequence's work being d * T(d) at the fewest ranks its
//          memory allows (d * T(d) only grows with d);
//   piece: the largest indivisible piece, a sequence at its best ring size (communication
//          included) on the fastest rank;
//   waves: of a set S of wide sequences (each needing more than W / 17 ranks for memory), at
//          most c run at once, c being the most of S's narrowest whose memory minima sum to <= W;
//          their intervals form an interval graph of clique number <= c, hence c chains, one of
//          which holds ceil(|S| / c) of them: the step is at least the sum of the ceil(|S| / c)
//          smallest best times in S (checked for every S made of the k widest, k = 1, 2, ...).
// Memory minima use the largest per-rank capacity (and Eq. 3 when offloading is on). Inputs must
// have been validated (makePlan does so).
struct BoundParts {
  double work = 0;
  double piece = 0;
  double waves = 0;
  double value() const {
    const double a = work > piece ? work : piece;
    return a > waves ? a : waves;
  }
};
BoundParts lowerBound(const std::vector<int64_t>& lengths, const PlanOptions& opt);

}  // namespace planner
}  // namespace bytescale
