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

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
