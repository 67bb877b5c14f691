// IntervalTimeline::choose (peer_budget.h), a template over the caller's sizer so that it is
// inlined into the candidate loop (it runs for most candidates). Included by peer_budget.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "planner/peer_budget.h"

namespace bytescale {
namespace planner {
namespace detail {

template <class SizerFn>
IntervalTimeline::Choice IntervalTimeline::choose(int lo, int cap, int candidates, double H,
                                                  SizerFn&& sizer) const {
  const size_t R = t_.size();
  // widest[i]: the widest stretch of consecutive ranks free by times[i], the distinct run times
  // in increasing order: runs join their free neighbours in time order (union-find over runs).
  // Runs are taken from order_ (kept across rings) as the candidates need them; each stretch's
  // root knows its runs, and those of >= lo ranks are listed (the windows' search at a time).
  // The buffers are kept across calls (no allocation per ring) and read through plain pointers
  // (at most R runs and R distinct times), so that the loops keep them in registers.
  Scratch& sc = scratch_;
  for (std::vector<int>* v : {&sc.by_time, &sc.last, &sc.widest, &sc.parent, &sc.size, &sc.first,
                              &sc.end, &sc.acc_n, &sc.started, &sc.wide})
    v->resize(R);
  sc.times.resize(R);
  sc.acc_w.resize(R);
  sc.stamp.resize(R, 0);
  sc.on.assign(R, 0);
  sc.in_wide.assign(R, 0);
  int* const by_time = sc.by_time.data();  // the runs taken so far, in time order
  int* const last = sc.last.data();  // last[i]: the last position in by_time of a run free at times[i]
  int* const widest = sc.widest.data();
  double* const times = sc.times.data();
  int* const parent = sc.parent.data();
  int* const size = sc.size.data();
  int* const first = sc.first.data();  // per stretch (root): its runs [first, end)
  int* const end = sc.end.data();
  char* const on = sc.on.data();
  char* const in_wide = sc.in_wide.data();
  int* const wide = sc.wide.data();  // roots of stretches of >= lo ranks (stale ones skipped)
  double* const acc_w = sc.acc_w.data();
  int* const acc_n = sc.acc_n.data();
  int* const stamp = sc.stamp.data();
  int* const started = sc.started.data();
  const int* const rs = start_.data();
  const double* const rt = t_.data();
  const std::pair<double, int>* const order = order_.data();
  const int* const run_of = run_of_.data();
  size_t next = 0;  // the next run of order_ to take
  size_t n_taken = 0, n_times = 0, n_wide = 0;
  // parent[x]: the root of run x's stretch, for every run (a stretch is a range of runs, so a
  // join relabels the smaller one's range: no path to walk in find(); a run is relabelled only
  // when its stretch at least doubles in ranks, so at most log2(W) times a choice).
  auto find = [&](int x) { return parent[x]; };
  int best_width = 0;
  auto join = [&](int a, int b) {  // roots (a != b); returns the root of the union
    if (size[a] < size[b]) std::swap(a, b);
    for (int x = first[b]; x < end[b]; ++x) parent[x] = a;
    size[a] += size[b];
    first[a] = std::min(first[a], first[b]);
    end[a] = std::max(end[a], end[b]);
    return a;
  };
  auto next_time = [&]() {  // takes the runs of the next distinct time; false when none is left
    if (next == R) return false;
    const double t = order[next].first;
    while (next < R && order[next].first == t) {
      const int k = run_of[order[next++].second];
      by_time[n_taken++] = k;
      parent[k] = k;
      size[k] = rs[k + 1] - rs[k];
      first[k] = k;
      end[k] = k + 1;
      on[k] = 1;
      int c = k;  // k's root
      if (k > 0 && on[k - 1]) c = join(c, find(k - 1));  // k is its own root still
      if (static_cast<size_t>(k) + 1 < R && on[k + 1]) {
        const int b = find(k + 1);
        if (b != c) c = join(c, b);
      }
      best_width = std::max(best_width, size[c]);
      if (size[c] >= lo && !in_wide[c]) {
        in_wide[c] = 1;
        wide[n_wide++] = c;
      }
    }
    times[n_times] = t;
    widest[n_times] = best_width;
    last[n_times++] = static_cast<int>(n_taken) - 1;
    return true;
  };
  const std::vector<double>& P = prefix_;
  const double P_R = std::abs(P[R]);
  // Whether no window of d ranks free by times[i] can have a waste below thr: a window lies in
  // one stretch (a union-find component at times[i], which it holds while candidate i is looked
  // at), and its waste is at least that of the d latest-free ranks of its stretch. Runs are taken
  // latest-free first (cost t - free per rank, never decreasing), so the walk stops once every
  // stretch not yet complete needs more than thr. window() adds its waste up from prefix sums, so
  // a computed waste may sit below the true one by rounding (zero wastes come out a hair either
  // side of 0, and such a hair decides between them): thr is raised by far more than that error.
  auto cannot_beat = [&](size_t i, int d, double thr) {
    const double t = times[i];
    thr += 1e-9 * (d * std::abs(t) + P_R);
    const int epoch = ++sc.epoch;
    size_t n_started = 0;
    for (int q = last[i] + 1; q-- > 0;) {
      const int k = by_time[q];
      const int c = find(k);
      if (size[c] < d) continue;  // in a stretch too narrow for any window
      const double cost = t - rt[k];
      if (d * cost >= thr) {
        bool all = true;
        for (size_t u = 0; u < n_started; ++u) {
          const int o = started[u];
          if (acc_n[o] < d && acc_w[o] + (d - acc_n[o]) * cost < thr) all = false;
        }
        if (all) return true;
      }
      if (stamp[c] != epoch) {
        stamp[c] = epoch;
        acc_w[c] = 0;
        acc_n[c] = 0;
        started[n_started++] = c;
      }
      if (acc_n[c] >= d) continue;
      const int n = std::min(d - acc_n[c], rs[k + 1] - rs[k]);
      acc_w[c] += n * cost;
      acc_n[c] += n;
      if (acc_n[c] == d && acc_w[c] < thr) return false;
    }
    return true;
  };
  Choice best;
  bool have = false, best_fits = false;
  double best_waste = 0, best_finish = 0;
  int seen = 0;
  size_t i = 0;
  auto have_time = [&]() { return i < n_times || next_time(); };
  while (have_time() && widest[i] < lo) ++i;  // the earliest time an interval of lo is free
  for (; have_time(); ++i) {
    const double t = times[i];
    if (have && (seen >= candidates || (best_fits && t >= H))) break;
    ++seen;
    // With a fitting best, only a fitting candidate of less waste wins, and sizes are >= lo (a
    // waste bound for lo ranks holds for more): most candidates end here, without sizing.
    const double thr = best_waste * (1 - 1e-12);
    if (have && best_fits && cannot_beat(i, lo, thr)) continue;
    const int avail = std::min(widest[i], cap);
    const Size sz = sizer(t, avail);
    if (sz.d < 1 || sz.d > avail) continue;
    // An interval of sz.d ranks free by t exists (avail <= the widest); a candidate that does not
    // fit is ranked by its end alone, so its window is searched only if it is chosen (below).
    int start = -1;
    double waste = 0;
    if (sz.fits) {
      if (have && best_fits && sz.d > lo && cannot_beat(i, sz.d, thr)) continue;
      // window(t, sz.d) over the stretches at t (the union-find's now): those of >= lo ranks
      bool found = false;
      if (sz.d >= lo) {
        for (size_t u = 0; u < n_wide; ++u) {
          const int c = wide[u];
          if (parent[c] == c && size[c] >= sz.d)
            stretch(static_cast<size_t>(first[c]), static_cast<size_t>(end[c]), t, sz.d, P, found, start, waste);
        }
      } else {
        found = window(t, sz.d, P, start, waste);
      }
      if (!found) continue;
    }
    bool better;
    if (!have) better = true;
    else if (sz.fits != best_fits) better = sz.fits;
    else if (sz.fits) better = waste < best_waste * (1 - 1e-12);
    else better = sz.finish < best_finish * (1 - 1e-12);
    if (better) {
      have = true;
      best_fits = sz.fits;
      best_waste = waste;
      best_finish = sz.finish;
      best = {start, sz.d, t};
    }
    if (best_fits && best_waste == 0) break;
  }
  if (have && !best_fits) {
    double waste = 0;
    window(best.t, best.d, P, best.start, waste);
  }
  return best;
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
