// Reference schedules that measure the strategies (pure C++, no torch): an exhaustive search that
// proves the optimum of small instances, and a local search for worlds too large to enumerate.
// makePlan never calls them; tests/cpp/test_planner_reference.cpp and benchmarks/bench_planner.py
// do.
//
// Both search the space the strategies plan in: every sequence either whole on one rank (its
// capacity permitting) or on a ring of any d ranks, d at least its memory minimum at the smallest
// capacity among the ring's members (Eq. 3 when offloading); any members, any start, any per-rank
// order. Both price a schedule with the cost model (a ring runs at its slowest member's pace) and
// judge it by the replay's synchronised step (csrc/planner/replay.h); the plan they return is
// replayed by replay() like any other. Both search the unbounded problem: PlanOptions::peer_budget
// is ignored (any members), so they are references for bounded plans too.
//
// Why a search over orders and class mixes is exhaustive. Group the ranks into classes of equal
// (speed, capacity); a sequence's "mix" is how many ranks of each class it runs on. Take any
// schedule, replay it, and list its sequences by start time. Rebuild it greedily in that order:
// each sequence keeps its mix but takes the earliest-free ranks of each class, starting when the
// last of them is free. By induction along the list, every class's sorted free times stay at or
// below the original's, the original's counted from the current start on (every later sequence
// starts no earlier, so a rank the original freed before that start is as good as free at it); so
// the rebuilt step is no longer. Hence the optimum is the best greedy schedule over (order, mix of
// each sequence), and a mix that uses a sub-multiset of another's ranks for no longer is never
// needed. The search enumerates orders and non-dominated mixes depth first, pruned by a lower bound
// (every remaining sequence's earliest finish; the remaining work water-filled over the ranks' free
// times), a table of dominated states (same sequences placed, free times elementwise no earlier)
// and symmetry between sequences of equal length. The GoogleTest checks it against a brute force
// over every member subset and order on tiny instances.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/planner.h"

namespace bytescale {
namespace planner {

struct ReferencePlan {
  Plan plan;             // strategy "exact" or "search"; plan.makespan is its replayed step
  bool optimal = false;  // the exhaustive search finished: no schedule is shorter under the model
  int64_t work = 0;      // search nodes (exact) or schedules evaluated (local search)
};

// Exhaustive search (see above) for at most 10 sequences and 16 ranks; stops after `node_limit`
// nodes with the best schedule found (optimal = false then). Starts from the local search's
// schedule, so it is never worse than searchReference. Throws std::invalid_argument on bad input
// (as makePlan) and on an instance above the limits.
ReferencePlan exactReference(const std::vector<int64_t>& lengths, const PlanOptions& opt,
                             int64_t node_limit = 20000000);

// Local search: late-acceptance hill climbing over (order, mix of each sequence) with insert, swap
// and mix-change moves, `evaluations` greedy schedules in all (deterministic for a seed), from a
// longest-first earliest-finish start and, when given, from `start` (a plan of the same input,
// e.g. makePlan's; the greedy rebuild of its start order is never longer than it, so the result is
// never worse than `start`). At most 64 rank classes' mixes per sequence are enumerated: throws
// std::invalid_argument when the classes allow more than 2^20 mixes.
ReferencePlan searchReference(const std::vector<int64_t>& lengths, const PlanOptions& opt,
                              int64_t evaluations, uint64_t seed = 1, const Plan* start = nullptr);

}  // namespace planner
}  // namespace bytescale
