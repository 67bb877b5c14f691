// The planner's feasibility rule: which single sequences a plan of given options can hold at all
// (pure C++, no torch).
//
// A sequence of s tokens can be placed when it fits the largest rank, or when its memory floor
// (offloadFloor at the smallest rank capacity: without offloading ceil(Act(s) / Act(C)), with it
// Eq. 3's minimum) needs at most world_size ranks; under the static DP x CP baseline its CP group
// must hold it too (static_cp x C, or, sized per step, the largest power-of-two degree that divides
// the world). The planner's Context refuses a batch by the same rule (placeable), so a length that
// passes here never makes makePlan throw for want of ranks.
#pragma once

#include <cstdint>

#include "planner/planner.h"

namespace bytescale {
namespace planner {

// Lengths above this are refused by every strategy (validateInput).
constexpr int64_t kMaxSequence = int64_t{1} << 40;

// The memory part of the rule, as the planner's Context applies it (cap_min, cap_max: the
// smallest and largest rank capacity after multipliers).
bool placeable(const PlanOptions& opt, int64_t s, int64_t cap_min, int64_t cap_max);

class Feasibility {
 public:
  // Throws std::invalid_argument on options the planner would refuse (world size, capacity,
  // multiplier count, cost model, static CP degree).
  explicit Feasibility(const PlanOptions& opt);
  // Whether a sequence of s >= 1 tokens can be placed (memory, and the static baseline's CP group).
  bool fits(int64_t s) const;
  // The largest L such that every length in [1, L] fits (kMaxSequence when all do). Exact: the
  // memory floor is monotone without offloading and piecewise monotone with it (Eq. 3 is a
  // concave quadratic in s where offloading is bounded by the copy bandwidth, increasing
  // elsewhere), so a bisection per monotone piece finds the first length that does not fit.
  int64_t longest() const;

 private:
  bool memoryFits(int64_t s) const { return placeable(opt_, s, cap_min_, cap_max_); }
  PlanOptions opt_;
  int64_t cap_min_ = 0, cap_max_ = 0;
  int64_t static_limit_ = kMaxSequence;
};

}  // namespace planner
}  // namespace bytescale
