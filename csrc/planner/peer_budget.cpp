// The peer budget (peer_budget.h): validation, the ring order of an interval, windows, and the
// balanced strategy's timeline of intervals.
#include "planner/peer_budget.h"

#include <algorithm>
#include <deque>
#include <stdexcept>

namespace bytescale {
namespace planner {
namespace detail {

void validatePeerBudget(int budget) {
  if (budget < 0 || (budget > 0 && budget < 4))
    throw std::invalid_argument(
        "planner: peer_budget = " + std::to_string(budget) +
        " cannot be kept; use 0 (unbounded) or >= 4 (rings over intervals of the rank order with "
        "hops of at most 2 positions give every rank at most 4 ring neighbours; fewer cannot hold "
        "rings of every width)");
}

void orderBoundedRing(std::vector<int>& members, const std::string& strategy) {
  std::sort(members.begin(), members.end());
  const int d = static_cast<int>(members.size());
  for (int k = 1; k < d; ++k)
    if (members[k] != members[0] + k)
      throw std::logic_error("planner: strategy '" + strategy + "' formed a ring over ranks " +
                             std::to_string(members[0]) + ".." + std::to_string(members.back()) +
                             " that is not an interval of the rank order (peer budget broken)");
  if (d <= 2) return;
  const int a = members[0];
  int k = 0;
  for (int off = 0; off < d; off += 2) members[k++] = a + off;
  for (int off = (d - 1) % 2 == 1 ? d - 1 : d - 2; off >= 1; off -= 2) members[k++] = a + off;
}

int bestWindow(const std::vector<double>& key, int d, const std::vector<char>* ok) {
  const int W = static_cast<int>(key.size());
  if (d < 1 || d > W) return -1;
  std::deque<int> mx;  // indices of the window, key decreasing
  double sum = 0, best_max = 0, best_sum = 0;
  int best = -1, last_bad = -1;
  for (int r = 0; r < W; ++r) {
    if (ok && !(*ok)[r]) last_bad = r;
    while (!mx.empty() && key[mx.back()] <= key[r]) mx.pop_back();
    mx.push_back(r);
    sum += key[r];
    if (r >= d) sum -= key[r - d];
    const int a = r - d + 1;
    if (a < 0) continue;
    while (mx.front() < a) mx.pop_front();
    if (last_bad >= a) continue;
    const double m = key[mx.front()];
    if (best < 0 || m < best_max || (m == best_max && sum < best_sum)) {
      best = a;
      best_max = m;
      best_sum = sum;
    }
  }
  return best;
}

IntervalTimeline::IntervalTimeline(int W) : W_(W), start_{0, W}, t_{0.0} {}

double IntervalTimeline::freeAt(int r) const {
  const size_t k = static_cast<size_t>(std::upper_bound(start_.begin(), start_.end(), r) - start_.begin()) - 1;
  return t_[k];
}

void IntervalTimeline::each(const std::function<void(int, double)>& f) const {
  for (size_t k = 0; k < t_.size(); ++k)
    for (int r = start_[k]; r < start_[k + 1]; ++r) f(r, t_[k]);
}

void IntervalTimeline::occupy(int a, int d, double until) {
  auto split = [&](int x) {  // a run starts at x (x < W)
    const size_t k = static_cast<size_t>(std::upper_bound(start_.begin(), start_.end(), x) - start_.begin()) - 1;
    if (start_[k] == x) return;
    start_.insert(start_.begin() + static_cast<std::ptrdiff_t>(k) + 1, x);
    t_.insert(t_.begin() + static_cast<std::ptrdiff_t>(k) + 1, t_[k]);
  };
  split(a);
  if (a + d < W_) split(a + d);
  const auto k0 = std::lower_bound(start_.begin(), start_.end(), a) - start_.begin();
  const auto k1 = std::lower_bound(start_.begin(), start_.end(), a + d) - start_.begin();
  t_[k0] = until;
  start_.erase(start_.begin() + k0 + 1, start_.begin() + k1);
  t_.erase(t_.begin() + k0 + 1, t_.begin() + k1);
}

bool IntervalTimeline::window(double t, int d, const std::vector<double>& P, int& best_start,
                              double& best_waste) const {
  // P: prefix sums of free times at run starts. F(x): the sum over ranks [0, x), with a pointer
  // per monotone sequence of x (x at run starts + d, and run ends - d, both increase along runs).
  const size_t R = t_.size();
  struct Cursor {
    size_t k = 0;
  };
  auto F = [&](int x, Cursor& c) {
    if (x >= W_) return P[R];
    while (start_[c.k + 1] <= x) ++c.k;
    return P[c.k] + (x - start_[c.k]) * t_[c.k];
  };
  bool have = false;
  auto consider = [&](int x, double sum) {
    const double waste = d * t - sum;
    if (!have || waste < best_waste || (waste == best_waste && x < best_start)) {
      have = true;
      best_waste = waste;
      best_start = x;
    }
  };
  // The waste of a window is piecewise linear in its start, so a best window starts at a run's
  // start or ends at a run's end, inside a stretch of runs free by t.
  Cursor after_start, before_end;
  size_t k = 0;
  while (k < R) {
    if (t_[k] > t) {
      ++k;
      continue;
    }
    size_t e = k;
    while (e < R && t_[e] <= t) ++e;
    const int S = start_[k], E = start_[e];
    if (E - S >= d)
      for (size_t j = k; j < e; ++j) {
        if (start_[j] + d <= E) consider(start_[j], F(start_[j] + d, after_start) - P[j]);
        const int x = start_[j + 1] - d;
        if (x >= S) consider(x, P[j + 1] - F(x, before_end));
      }
    k = e;
  }
  return have;
}

IntervalTimeline::Choice IntervalTimeline::choose(int lo, int cap, int candidates, double H,
                                                  const Sizer& sizer) const {
  const size_t R = t_.size();
  // widest[i]: the widest stretch of consecutive ranks free by times[i], for every distinct run
  // time at once: runs join their free neighbours in time order (union-find over runs).
  std::vector<size_t> by_time(R);
  for (size_t k = 0; k < R; ++k) by_time[k] = k;
  std::stable_sort(by_time.begin(), by_time.end(), [&](size_t a, size_t b) { return t_[a] < t_[b]; });
  std::vector<double> times;
  std::vector<int> widest;
  std::vector<size_t> parent(R);
  std::vector<int> size(R, 0);
  std::vector<char> on(R, 0);
  auto find = [&](size_t x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  int best_width = 0;
  for (size_t q = 0; q < R; ++q) {
    const size_t k = by_time[q];
    parent[k] = k;
    size[k] = start_[k + 1] - start_[k];
    on[k] = 1;
    for (size_t nb : {k - 1, k + 1}) {
      if (nb >= R || !on[nb]) continue;  // k - 1 wraps to a huge index for k == 0
      size_t a = find(k), b = find(nb);
      if (a == b) continue;
      if (size[a] < size[b]) std::swap(a, b);
      parent[b] = a;
      size[a] += size[b];
    }
    best_width = std::max(best_width, size[find(k)]);
    if (q + 1 == R || t_[by_time[q + 1]] != t_[k]) {
      times.push_back(t_[k]);
      widest.push_back(best_width);
    }
  }
  std::vector<double> P(R + 1, 0.0);
  for (size_t k = 0; k < R; ++k) P[k + 1] = P[k] + (start_[k + 1] - start_[k]) * t_[k];
  Choice best;
  bool have = false, best_fits = false;
  double best_waste = 0, best_finish = 0;
  int seen = 0;
  size_t i = 0;
  while (i < times.size() && widest[i] < lo) ++i;  // the earliest time an interval of lo is free
  for (; i < times.size(); ++i) {
    const double t = times[i];
    if (have && (seen >= candidates || (best_fits && t >= H))) break;
    ++seen;
    const int avail = std::min(widest[i], cap);
    const Size sz = sizer(t, avail);
    int start = -1;
    double waste = 0;
    if (sz.d < 1 || sz.d > avail || !window(t, sz.d, P, start, waste)) continue;
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
  return best;
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
