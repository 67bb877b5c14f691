// The peer budget (peer_budget.h): validation, the ring order of an interval and windows (the
// balanced strategy's timeline of intervals: interval_timeline.cpp).
#include "planner/peer_budget.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <cmath>
#include <limits>
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

WindowTree::WindowTree(int W) : W_(W), key_(static_cast<size_t>(W), 0.0) {}

// The windows of d ranks starting at s0, s0 + 1, ..., s1 (s1 + d <= W): maximum (a deque of
// decreasing keys) and running sum, as bestWindow computes them.
void WindowTree::scan(int s0, int s1, std::vector<double>& mx, std::vector<double>& sm) const {
  mx.clear();
  sm.clear();
  std::deque<int> q;
  double sum = 0;
  for (int r = s0; r < s1 + d_; ++r) {
    while (!q.empty() && key_[q.back()] <= key_[r]) q.pop_back();
    q.push_back(r);
    sum += key_[r];
    if (r - s0 >= d_) sum -= key_[r - d_];
    const int a = r - d_ + 1;
    if (a < s0) continue;
    while (q.front() < a) q.pop_front();
    mx.push_back(key_[q.front()]);
    sm.push_back(sum);
  }
}

// The better of x's children (the least maximum, then sum; ties to the left one: lower starts).
void WindowTree::pull(int x) {
  const int l = 2 * x, r = l + 1;
  const bool right = (m_[r] < m_[l]) | ((m_[r] == m_[l]) & (s_[r] < s_[l]));
  const int c = l + static_cast<int>(right);
  m_[x] = m_[c] + lz_[x];
  s_[x] = s_[c] + lz_[x] * d_;
  a_[x] = a_[c];
}

void WindowTree::shift(int x, double v) {
  m_[x] += v;  // every key of the windows below gains v: their maximum gains exactly v
  s_[x] += v * d_;
  lz_[x] += v;
}

void WindowTree::rebuild(int d) {
  d_ = d;
  S_ = W_ - d + 1;
  N_ = 1;
  while (N_ < S_) N_ <<= 1;
  const double inf = std::numeric_limits<double>::infinity();
  const size_t n = 2 * static_cast<size_t>(N_);  // sized once (widths only shrink, mostly)
  if (m_.size() < n) {
    m_.resize(n);
    s_.resize(n);
    a_.resize(n);
    lz_.resize(n);
  }
  // Every window's maximum from running maxima inside blocks of d ranks (van Herk / Gil-Werman):
  // the window at a spans the end of a's block and the start of the next.
  std::vector<double>& pre = mx_;
  std::vector<double>& suf = sm_;
  pre.resize(static_cast<size_t>(W_));
  suf.resize(static_cast<size_t>(W_));
  for (int b = 0; b < W_; b += d) {
    const int e = std::min(b + d, W_);
    pre[b] = key_[b];
    for (int r = b + 1; r < e; ++r) pre[r] = std::max(pre[r - 1], key_[r]);
    suf[e - 1] = key_[e - 1];
    for (int r = e - 2; r >= b; --r) suf[r] = std::max(suf[r + 1], key_[r]);
  }
  double sum = 0;
  for (int r = 0; r < d - 1; ++r) sum += key_[r];
  for (int a = 0; a < S_; ++a) {
    sum += key_[a + d - 1];  // the running sum, as scan() and bestWindow
    if (a > 0) sum -= key_[a - 1];
    a_[N_ + a] = a;
    m_[N_ + a] = std::max(suf[a], pre[a + d - 1]);
    s_[N_ + a] = sum;
    lz_[N_ + a] = 0;
  }
  for (int a = S_; a < N_; ++a) {
    a_[N_ + a] = a;
    m_[N_ + a] = s_[N_ + a] = inf;
    lz_[N_ + a] = 0;
  }
  for (int x = N_ - 1; x >= 1; --x) {
    lz_[x] = 0;
    pull(x);
  }
}

// Windows starting at [p, q] get the values mx_ / sm_ (indexed from p); pending adds pushed down.
void WindowTree::assign(int x, int l, int r, int p, int q) {
  if (q < l || r < p) return;
  if (l == r) {
    m_[x] = mx_[l - p];
    s_[x] = sm_[l - p];
    return;
  }
  if (lz_[x] != 0) {
    shift(2 * x, lz_[x]);
    shift(2 * x + 1, lz_[x]);
    lz_[x] = 0;
  }
  const int m = (l + r) / 2;
  assign(2 * x, l, m, p, q);
  assign(2 * x + 1, m + 1, r, p, q);
  pull(x);
}

void WindowTree::addRange(int x, int l, int r, int p, int q, double v) {
  if (q < l || r < p) return;
  if (p <= l && r <= q) {
    shift(x, v);
    return;
  }
  const int m = (l + r) / 2;
  addRange(2 * x, l, m, p, q, v);
  addRange(2 * x + 1, m + 1, r, p, q, v);
  pull(x);
}

void WindowTree::rescan(int p, int q) {
  p = std::max(p, 0);
  q = std::min(q, S_ - 1);
  if (p > q) return;
  scan(p, q, mx_, sm_);
  assign(1, 0, N_ - 1, p, q);
}

void WindowTree::add(int a, int d, double v) {
  for (int r = a; r < a + d; ++r) key_[r] += v;
  if (d_ == 0) return;
  // Windows inside [a, a + d) gain v on every key; those overlapping it in part are scanned again.
  if (d_ <= d) {
    addRange(1, 0, N_ - 1, a, std::min(a + d - d_, S_ - 1), v);
    rescan(a - d_ + 1, a - 1);
    rescan(a + d - d_ + 1, a + d - 1);
  } else {
    rescan(a - d_ + 1, a + d - 1);
  }
}

int WindowTree::best(int d) {
  if (d < 1 || d > W_) return -1;
  if (d != d_) rebuild(d);
  return a_[1];
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
