// Internal to the planner: the peer budget (PlanOptions::peer_budget).
//
// NCCL keeps point-to-point buffers for every peer a rank has ever exchanged with (NCCL issue
// #2294: they scale with nChannels x nPeers) and never frees them, so over a run the ranks a rank
// exchanges ring traffic with must stay few. The budget holds without any state across steps:
//   * every ring is a contiguous interval [a, a + d) of the rank order (units in rank order: the
//     ranks of a node are consecutive, so small rings stay inside a node);
//   * its members are ordered a, a+2, a+4, ..., (the largest of a's parity), then the others
//     descending, ..., a+3, a+1: every hop (the wrap-around included) spans 1 or 2 positions.
// A rank r's ring neighbours are then always among r-2, r-1, r+1, r+2: at most 4 over any number
// of steps, whatever the ring sizes. A budget K >= 4 is met by that; K in 1..3 is refused (rings of
// every width cannot keep it). Where every rank has at most K other ranks (world_size - 1 <= K)
// the budget cannot bind and the plan is the unbounded one.
//
// Each ring-forming strategy picks its members as an interval: naive / pow2 the window of d ranks
// holding the fewest tokens (the least maximum, then the least sum), balanced the interval of
// ranks free by the ring's start that wastes least (intervalTimeline below), static its replicas
// (already consecutive), pp-balance / pp-lockstep windows of consecutive pipelines. The balanced
// strategy's list-schedule refinement (small instances) is skipped under a binding budget.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "planner/planner.h"

namespace bytescale {
namespace planner {
namespace detail {

// Whether the budget binds for these options (K > 0 and a rank could otherwise exceed it).
inline bool peerBounded(const PlanOptions& o) {
  return o.peer_budget > 0 && o.world_size - 1 > o.peer_budget;
}

// Throws std::invalid_argument naming the value when the budget is negative or in 1..3.
void validatePeerBudget(int budget);

// `members` (any order) must be an interval of ranks; reorders them into the ring order above.
// Throws std::logic_error naming the ranks otherwise (a strategy broke the budget).
void orderBoundedRing(std::vector<int>& members, const std::string& strategy);

// The start a of the window [a, a + d) of `key` with the least maximum, then the least sum, then
// the lowest a; only windows whose ranks all have ok[r] (when ok is given). -1 when none exists.
int bestWindow(const std::vector<double>& key, int d, const std::vector<char>* ok = nullptr);

// bestWindow over keys that change by adding a value to an interval (naive / pow2's tokens): a
// segment tree over the windows' starts holding each window's (maximum, sum) and the least of
// them (then the lowest start) per node. A window inside an added interval gains v on its
// maximum and d x v on its sum (lazily, per node); the at most 2 (d - 1) windows overlapping it in
// part are scanned again. So one ring costs O(d + log W), and a new width a rebuild in O(W) (the
// widths come longest first, so a plan rebuilds once per distinct width). The same rule as
// bestWindow; a window's sum is bestWindow's running sum plus the lazy adds, so sums that tie
// exactly may round apart at the last bit and pick another of the tied windows.
class WindowTree {
 public:
  explicit WindowTree(int W);
  void add(int a, int d, double v);  // keys of ranks [a, a + d) gain v (key += v, in rank order)
  int best(int d);                   // as bestWindow(keys, d); -1 when d < 1 or d > W

 private:
  int W_, d_ = 0, S_ = 0, N_ = 0;  // d_: the width the tree holds; S_ = W_ - d_ + 1 starts
  std::vector<double> key_, m_, s_, lz_, mx_, sm_;
  std::vector<int> a_;
  void scan(int s0, int s1, std::vector<double>& mx, std::vector<double>& sm) const;
  void pull(int x);
  void shift(int x, double v);
  void rebuild(int d);
  void assign(int x, int l, int r, int p, int q);
  void addRange(int x, int l, int r, int p, int q, double v);
  void rescan(int p, int q);
};

// The free times of ranks during the balanced strategy's ring placement as runs of equal time
// (only rings change them then, so there are at most 2 x rings + 1 runs, whatever the world size).
class IntervalTimeline {
 public:
  explicit IntervalTimeline(int W);

  // A ring's size at a candidate start time t, given the widest interval free by t (capped by the
  // caller): d (at least choose's lo), whether it ends within the horizon, and when it ends
  // (read only when it does not fit).
  struct Size {
    int d;
    bool fits;
    double finish;
  };
  struct Choice {
    int start = -1, d = 0;
    double t = 0;
  };
  // The balanced strategy's choice (balanced.cpp's file comment) over intervals: candidate start
  // times are the run times from the earliest instant an interval of `lo` ranks is free, at most
  // `candidates` of them (more than the unbounded planner's 6: an interval is free later than as
  // many scattered ranks, so later starts are worth a look); at each, the size from `sizer` and the interval of that size free by t
  // that wastes least (the sum of t - free over its ranks; then the lowest start). Among the
  // candidates ending within H the least waste wins (then the earliest), else the earliest end.
  // sizer: Size(double t, int avail); a template (interval_timeline_choose.h) so that it is
  // inlined: it runs for most candidates.
  template <class SizerFn>
  Choice choose(int lo, int cap, int candidates, double H, SizerFn&& sizer) const;

  double freeAt(int r) const;
  // out[i] = freeAt(a + i) for i in [0, d), a run at a time.
  void freeTimes(int a, int d, std::vector<double>& out) const;
  // Ranks [a, a + d) become free at `until`.
  void occupy(int a, int d, double until);
  // Every rank with its free time (for the balanced strategy's locals).
  void each(const std::function<void(int rank, double t)>& f) const;
  // Every run: ranks [a, e) free at t, in rank order (each() a run at a time).
  void eachRun(const std::function<void(int a, int e, double t)>& f) const;

 private:
  int W_;
  std::vector<int> start_;   // run k covers [start_[k], start_[k+1]) (start_.back() == W_)
  std::vector<double> t_;    // run k's free time
  // Kept across rings (occupy() changes a few runs): the runs by (free time, start), which is
  // choose()'s time order, and each run's index by its start rank.
  std::vector<std::pair<double, int>> order_, order_next_;  // order_next_: occupy()'s buffer
  std::vector<int> run_of_;
  std::vector<double> prefix_;  // prefix_[k]: the sum of free times over ranks [0, start_[k])
  struct Scratch {  // choose()'s buffers, kept across calls (what each holds: see choose())
    std::vector<int> by_time, last, widest, parent, size, first, end, acc_n, stamp, started,
        wide;
    std::vector<double> times, acc_w;
    std::vector<char> on, in_wide;
    int epoch = 0;
  };
  mutable Scratch scratch_;
  // the least-waste window of d ranks free by t: start and waste (false when none)
  bool window(double t, int d, const std::vector<double>& prefix, int& start, double& waste) const;
  // window()'s search inside one stretch: runs [k, e) free by t, at least d ranks wide
  void stretch(size_t k, size_t e, double t, int d, const std::vector<double>& prefix, bool& have,
               int& start, double& waste) const;
};

}  // namespace detail
}  // namespace planner
}  // namespace bytescale

#include "planner/interval_timeline_choose.h"  // choose()
