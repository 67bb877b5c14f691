// The balanced strategy's timeline of intervals under the peer budget (IntervalTimeline,
// peer_budget.h): runs of equal free time, kept across rings, and the choice of each ring's
// interval.
#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include "planner/peer_budget.h"

namespace bytescale {
namespace planner {
namespace detail {

IntervalTimeline::IntervalTimeline(int W)
    : W_(W), start_{0, W}, t_{0.0}, order_{{0.0, 0}}, run_of_(static_cast<size_t>(W) + 1, 0),
      prefix_{0.0, 0.0} {}

double IntervalTimeline::freeAt(int r) const {
  const size_t k = static_cast<size_t>(std::upper_bound(start_.begin(), start_.end(), r) - start_.begin()) - 1;
  return t_[k];
}

void IntervalTimeline::freeTimes(int a, int d, std::vector<double>& out) const {
  out.resize(static_cast<size_t>(d));
  size_t k = static_cast<size_t>(std::upper_bound(start_.begin(), start_.end(), a) - start_.begin()) - 1;
  for (int r = a; r < a + d; ++r) {
    while (start_[k + 1] <= r) ++k;
    out[static_cast<size_t>(r - a)] = t_[k];
  }
}

void IntervalTimeline::each(const std::function<void(int, double)>& f) const {
  for (size_t k = 0; k < t_.size(); ++k)
    for (int r = start_[k]; r < start_[k + 1]; ++r) f(r, t_[k]);
}

void IntervalTimeline::eachRun(const std::function<void(int, int, double)>& f) const {
  for (size_t k = 0; k < t_.size(); ++k) f(start_[k], start_[k + 1], t_[k]);
}

void IntervalTimeline::occupy(int a, int d, double until) {
  // Runs [lo, hi) give way to (a, until) and, where a + d falls inside a run, that run's rest
  // (a + d, its time): one splice of start_ / t_ (a run cut at a keeps its start and time; runs
  // of equal time are not merged), and the same runs in the time order.
  const int b = a + d;
  const size_t R = t_.size();
  const size_t ka = static_cast<size_t>(std::upper_bound(start_.begin(), start_.end(), a) - start_.begin()) - 1;
  const size_t kb = b < W_ ? static_cast<size_t>(std::upper_bound(start_.begin() + ka, start_.end(), b) - start_.begin()) - 1 : R;
  const bool cut_b = b < W_ && start_[kb] != b;
  const double t_tail = cut_b ? t_[kb] : 0.0;
  const size_t lo = start_[ka] == a ? ka : ka + 1;
  const size_t hi = cut_b ? kb + 1 : kb;
  const size_t n_new = cut_b ? 2 : 1;
  // The time order: drop the runs starting in [a, b), merge in the (at most 2) new ones (keys are
  // unique: one run per start), in one pass.
  std::pair<double, int> add[2] = {{until, a}, {t_tail, b}};
  if (n_new == 2 && add[1] < add[0]) std::swap(add[0], add[1]);
  std::vector<std::pair<double, int>>& next = order_next_;
  next.clear();
  size_t q = 0;
  for (const std::pair<double, int>& e : order_) {
    if (e.second >= a && e.second < b) continue;
    while (q < n_new && add[q] < e) next.push_back(add[q++]);
    next.push_back(e);
  }
  while (q < n_new) next.push_back(add[q++]);
  order_.swap(next);
  // start_ (R + 1 entries, the last W) and t_: the slots [lo, hi) become n_new.
  const size_t n_old = hi - lo;
  if (n_new > n_old) {
    start_.insert(start_.begin() + static_cast<std::ptrdiff_t>(lo), n_new - n_old, 0);
    t_.insert(t_.begin() + static_cast<std::ptrdiff_t>(lo), n_new - n_old, 0.0);
  } else if (n_new < n_old) {
    start_.erase(start_.begin() + static_cast<std::ptrdiff_t>(lo + n_new), start_.begin() + static_cast<std::ptrdiff_t>(hi));
    t_.erase(t_.begin() + static_cast<std::ptrdiff_t>(lo + n_new), t_.begin() + static_cast<std::ptrdiff_t>(hi));
  }
  start_[lo] = a;
  t_[lo] = until;
  if (cut_b) {
    start_[lo + 1] = b;
    t_[lo + 1] = t_tail;
  }
  // Runs before lo keep their index and prefix sum (a cut may have made run lo - 1 end at a);
  // the sums from there on are added up as before (the same order: the same values).
  prefix_.resize(start_.size());
  for (size_t k = lo > 0 ? lo - 1 : 0; k + 1 < start_.size(); ++k) {
    run_of_[static_cast<size_t>(start_[k])] = static_cast<int>(k);
    prefix_[k + 1] = prefix_[k] + (start_[k + 1] - start_[k]) * t_[k];
  }
}

void IntervalTimeline::stretch(size_t k, size_t e, double t, int d, const std::vector<double>& P,
                               bool& have, int& best_start, double& best_waste) const {
  // P: prefix sums of free times at run starts. F(x): the sum over ranks [0, x), with a pointer
  // per monotone sequence of x (x at run starts + d, and run ends - d, both increase along runs).
  const size_t R = t_.size();
  auto F = [&](int x, size_t& c) {
    if (x >= W_) return P[R];
    while (start_[c + 1] <= x) ++c;
    return P[c] + (x - start_[c]) * t_[c];
  };
  auto consider = [&](int x, double sum) {
    const double waste = d * t - sum;
    if (!have || waste < best_waste || (waste == best_waste && x < best_start)) {
      have = true;
      best_waste = waste;
      best_start = x;
    }
  };
  size_t after_start = k, before_end = k;
  const int S = start_[k], E = start_[e];
  for (size_t j = k; j < e; ++j) {
    if (start_[j] + d <= E) consider(start_[j], F(start_[j] + d, after_start) - P[j]);
    const int x = start_[j + 1] - d;
    if (x >= S) consider(x, P[j + 1] - F(x, before_end));
  }
}

bool IntervalTimeline::window(double t, int d, const std::vector<double>& P, int& best_start,
                              double& best_waste) const {
  // The waste of a window is piecewise linear in its start, so a best window starts at a run's
  // start or ends at a run's end, inside a stretch of runs free by t. The best is the least
  // (waste, start), whatever order the stretches are searched in.
  const size_t R = t_.size();
  bool have = false;
  size_t k = 0;
  while (k < R) {
    if (t_[k] > t) {
      ++k;
      continue;
    }
    size_t e = k;
    while (e < R && t_[e] <= t) ++e;
    if (start_[e] - start_[k] >= d) stretch(k, e, t, d, P, have, best_start, best_waste);
    k = e;
  }
  return have;
}

IntervalTimeline::Choice IntervalTimeline::choose(int lo, int cap, int candidates, double H,
                                                  const Sizer& sizer) const {
  const size_t R = t_.size();
  // widest[i]: the widest stretch of consecutive ranks free by times[i], the distinct run times
  // in increasing order: runs join their free neighbours in time order (union-find over runs).
  // Runs are taken from order_ (kept across rings) as the candidates need them; each stretch's
  // root knows its runs, and those of >= lo ranks are listed (the windows' search at a time).
  // The buffers are kept across calls (no allocation per ring) and read through plain pointers
  // (at most R runs and R distinct times), so that the loops keep them in registers.
  Scratch& sc = scratch_;
  for (std::vector<int>* v : {&sc.by_time, &sc.last, &sc.widest, &sc.parent, &sc.size, &sc.first,
                              &sc.end, &sc.root_at, &sc.acc_n, &sc.started, &sc.wide})
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
  int* const root_at = sc.root_at.data();
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
  auto find = [&](int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  int best_width = 0;
  // A run joins the stretches ending just before it and starting just after it: root_at holds
  // each stretch's root at its first and last run, so the joins need no find() (the roots, and
  // so the union by size, are the same as with it).
  auto join = [&](int a, int b) {  // roots; returns the root of the union
    if (size[a] < size[b]) std::swap(a, b);
    parent[b] = a;
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
      if (k > 0 && on[k - 1]) c = join(c, root_at[k - 1]);
      if (static_cast<size_t>(k) + 1 < R && on[k + 1]) c = join(c, root_at[k + 1]);
      root_at[first[c]] = c;
      root_at[end[c] - 1] = c;
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
