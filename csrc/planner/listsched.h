// Internal to the planner: list schedules, the space the exhaustive reference searches and the
// balanced strategy refines small plans in (pure C++, no torch).
//
// Ranks are grouped into classes of equal (speed, capacity). A sequence's "mix" is how many ranks
// of each class it runs on: one rank (a local sequence, its capacity permitting) or a ring of
// d >= 2 ranks, d at least the memory minimum at the smallest capacity among them (Eq. 3 when
// offloading); a ring runs at its slowest member's pace. Only non-dominated mixes are kept: a mix
// that uses a sub-multiset of another's ranks for no longer is never needed.
//
// A list schedule takes the sequences in a given order and starts each on the earliest-free ranks
// of each class its mix names, when the last of them is free. Every schedule is matched by a list
// schedule no longer than it: replay it, list its sequences by start time and rebuild greedily in
// that order with the same mixes; by induction along the list, every class's sorted free times stay
// at or below the original's counted from the current start on (every later sequence starts no
// earlier, so a rank the original freed before that start is as good as free at it). The list
// schedule of an order is the replay of the per-rank lists it emits (csrc/planner/replay.h), ring
// ids in list order, so the replayed step is the one computed here.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "planner/planner.h"

namespace bytescale {
namespace planner {
namespace detail {

constexpr double kNoHorizon = std::numeric_limits<double>::infinity();

// One way to run a sequence: c[k] ranks of class k (d in all), for `dur` seconds on each.
struct Mix {
  std::vector<int> c;
  int d = 0;
  double dur = 0;
  double ratio = 0;  // offload ratio of a ring
  double work = 0;   // dur x the members' speeds: the capacity of the ranks it occupies
};

class ListModel {
 public:
  // Throws std::invalid_argument when the classes allow more than `max_mixes` mixes per sequence
  // or a sequence fits no set of ranks. Inputs must have been validated (makePlan's checks).
  ListModel(const std::vector<int64_t>& lengths, const PlanOptions& opt, size_t max_mixes);

  // The classes allow at most this many mixes per sequence (prod over classes of count + 1, - 1).
  static double mixCount(const PlanOptions& opt);

  const PlanOptions& opt;
  const std::vector<int64_t>& len;
  int W = 0, K = 0, n = 0;
  std::vector<int> off, count;          // class k: profile slots [off[k], off[k] + count[k])
  std::vector<double> speed;            // per class
  std::vector<int64_t> cap;             // per class
  std::vector<std::vector<int>> ranks;  // per class, ascending
  std::vector<std::vector<Mix>> mixes;  // per sequence, by duration
  std::vector<double> min_work;         // per sequence

  // A profile: per class, the free times ascending (W entries); `ids` the ranks alongside.
  void initProfile(std::vector<double>& prof, std::vector<int>* ids) const;
  double startOf(const Mix& m, const double* prof) const;
  // Places the mix on the earliest-free ranks of each class; returns its end. `members`, when
  // given, receives their ranks (needs `ids`).
  double place(const Mix& m, double* prof, int* ids, std::vector<int>* members) const;
  double profileMax(const double* prof) const;

  // The mix of sequence i for a list schedule: mix[i] when >= 0, else (-1: chosen on the way) the
  // one with the least work that ends by `horizon`, or the one ending first if none does (or if
  // the horizon is kNoHorizon).
  int choose(int i, const std::vector<int>& mix, const double* prof, double horizon) const;

  // The list schedule's step from position `from` on, whose profile is prof_at[from] (W entries
  // per position) and running maximum max_at[from]; fills the later positions.
  double evaluate(const std::vector<int>& order, const std::vector<int>& mix, double horizon,
                  int from, std::vector<double>& prof_at, std::vector<double>& max_at) const;
  // Fixes the open (-1) mixes to the ones the list schedule chooses under `horizon`.
  void fix(const std::vector<int>& order, std::vector<int>& mix, double horizon) const;
  // Its step from scratch.
  double step(const std::vector<int>& order, const std::vector<int>& mix, double horizon) const;
  // The list schedule as a plan (strategy `name`).
  Plan build(const std::vector<int>& order, const std::vector<int>& mix, double horizon,
             const char* name) const;
  // A plan's start order and each sequence's mix (a kept mix no longer than, and on a sub-multiset
  // of, the plan's ranks for it): its list schedule is no longer than the plan. False if the plan
  // does not belong to this input.
  bool fromPlan(const Plan& p, std::vector<int>& order, std::vector<int>& mix) const;
  // Sequence indices, longest first (ties: input position).
  std::vector<int> longestFirst() const;
};

// Late-acceptance hill climbing over (order, mixes; -1 entries choose on the way) with insert,
// swap and mix-change moves, `evals` list schedules (deterministic for the generator's state).
// Leaves the best solution found in (order, mix) and returns its step; `used` counts schedules.
double lateAcceptance(const ListModel& M, std::vector<int>& order, std::vector<int>& mix,
                      double horizon, int64_t evals, std::mt19937_64& rng, int64_t& used);

// Best-improvement descent: each sequence in turn (last position first) is tried at every
// position with every mix (and -1), with and without opening the later sequences' mixes; the best
// improving candidate is kept (its open mixes fixed). Stops at a local optimum or after `evals`
// schedules. Returns the step of (order, mix).
double reinsertDescent(const ListModel& M, std::vector<int>& order, std::vector<int>& mix,
                       double horizon, int64_t evals, int64_t& used);

// Beam search over list schedules: positions are filled one at a time, each state extended by
// every unplaced sequence with every mix, the `width` extensions with the smallest bound kept (the
// latest free time, and the remaining least work water-filled over the free times); `width` is
// what `placements` allows (1 .. 256). Returns the best complete schedule's step.
double beamSearch(const ListModel& M, int64_t placements, std::vector<int>& order,
                  std::vector<int>& mix, int64_t& used);

// Depth-first branch and bound over (order, mixes): children by their end, pruned by a lower
// bound (the latest free time; every remaining sequence's earliest end; the remaining least work
// water-filled over the free times), by a table of dominated states (same sequences placed, free
// times elementwise no earlier than an explored state's) and by symmetry between sequences of
// equal length. Looks for a schedule shorter than `incumbent`; `complete`: the search finished
// within `node_limit` nodes, so no list schedule (hence no schedule) beats the best known step.
constexpr int kMaxSearchSequences = 12;
struct SearchResult {
  bool improved = false;  // found a schedule shorter than the incumbent (in order, mix)
  bool complete = false;
  double step = 0;        // the best step known (the incumbent's if not improved)
  int64_t nodes = 0;
};
SearchResult branchAndBound(const ListModel& M, double incumbent, int64_t node_limit,
                            std::vector<int>& order, std::vector<int>& mix);

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
