#include "planner/bound.h"

#include <algorithm>
#include <cmath>

#include "planner/offload_rule.h"
#include "planner/planner.h"

namespace bytescale {
namespace planner {

bool commExposed(const CostModel& m, double s, int d) {
  if (d <= 1) return false;
  // exposed <=> 3(d-1)(latency + kv*s/(d*bw)) > a1*s^2/d, multiplied by d > 0 (monotone in d)
  const double lhs = 3.0 * (d - 1) * (m.ring_latency * d + m.kv_bytes_per_token * s / m.ring_bw);
  return lhs > m.a1 * s * s;
}

RingShape ringShape(const CostModel& m, double s, int lo, int hi) {
  RingShape r;
  r.lo = std::max(1, lo);
  r.hi = std::max(r.lo, hi);
  // crossing: first exposed d in [lo, hi], hi + 1 if none (binary search: exposure is monotone)
  int a = r.lo, b = r.hi + 1;
  while (a < b) {
    const int mid = a + (b - a) / 2;
    if (commExposed(m, s, mid)) b = mid;
    else a = mid + 1;
  }
  r.crossing = a;
  // Candidates: the ends, both sides of the crossing, and the minimum of the exposed branch
  //   T/L = const + 3*lat*d + c/d,  c = (b1 - 3*kv/bw) * s   (convex when c > 0).
  int cand[8];
  int n = 0;
  cand[n++] = r.lo;
  cand[n++] = r.hi;
  cand[n++] = r.crossing - 1;
  cand[n++] = r.crossing;
  const double c = (m.b1 - 3.0 * m.kv_bytes_per_token / m.ring_bw) * s;
  if (c > 0) {
    if (m.ring_latency > 0) {
      const double dstar = std::sqrt(c / (3.0 * m.ring_latency));
      const double fl = std::floor(std::min(dstar, static_cast<double>(r.hi)));
      cand[n++] = static_cast<int>(fl);
      cand[n++] = static_cast<int>(fl) + 1;
    }
  }
  double best_t = 0;
  r.best = -1;
  for (int i = 0; i < n; ++i) {
    const int d = std::clamp(cand[i], r.lo, r.hi);
    const double t = m.shardedTime(s, d);
    if (r.best < 0 || t < best_t || (t == best_t && d < r.best)) {
      best_t = t;
      r.best = d;
    }
  }
  return r;
}

int minRanksWithin(const CostModel& m, double s, const RingShape& sh, double budget) {
  if (m.shardedTime(s, sh.lo) <= budget) return sh.lo;
  if (m.shardedTime(s, sh.best) > budget) return -1;
  // T decreases on [lo, crossing - 1] and on [crossing, best] (convex branch left of its minimum).
  auto search = [&](int a, int b) {  // smallest d in [a, b] with T(d) <= budget, T(b) <= budget
    while (a < b) {
      const int mid = a + (b - a) / 2;
      if (m.shardedTime(s, mid) <= budget) b = mid;
      else a = mid + 1;
    }
    return a;
  };
  const int hidden_end = std::min(sh.crossing - 1, sh.best);
  if (hidden_end >= sh.lo && m.shardedTime(s, hidden_end) <= budget) return search(sh.lo, hidden_end);
  return search(std::max(sh.lo, std::min(sh.crossing, sh.best)), sh.best);
}

BoundParts lowerBound(const std::vector<int64_t>& lengths, const PlanOptions& opt) {
  const CostModel& cm = opt.cost;
  const int W = opt.world_size;
  int64_t cap_max = 1;
  double speed_sum = 0, speed_max = 0;
  for (int r = 0; r < W; ++r) {
    cap_max = std::max(cap_max, rankCapacity(opt, r));
    const double v = opt.speed.empty() ? 1.0 : opt.speed[r];
    speed_sum += v;
    speed_max = std::max(speed_max, v);
  }
  double work = 0, piece = 0;
  std::vector<std::pair<int, double>> big;  // (memory minimum, best time) of wide sequences
  for (int64_t s : lengths) {
    const double sd = static_cast<double>(s);
    int dmin = 1;
    if (s > cap_max)
      dmin = offloadFloor(opt, s, cap_max).ranks;
    dmin = std::min(dmin, W);
    work += dmin * cm.shardedTime(sd, dmin);
    const bool wide = 17LL * dmin > W;
    // Only the longest sequences can set the piece; their best ring size costs O(log W).
    const double piece_ub = cm.shardedTime(sd, dmin) / speed_max;
    if (piece_ub <= piece && !wide) continue;
    const RingShape sh = ringShape(cm, sd, dmin, W);
    const double best = cm.shardedTime(sd, sh.best) / speed_max;
    piece = std::max(piece, best);
    if (wide) big.emplace_back(dmin, best);
  }
  // waves: S = the widest sequences (a prefix by memory minimum, widest first). At any instant
  // the running ones fit the world, so at most c(S) of them run at once, c(S) being the most of
  // S's narrowest whose widths still sum to <= W.
  double waves = 0;
  std::stable_sort(big.begin(), big.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<double> times;  // best times of S, ascending
  for (size_t k = 0; k < big.size(); ++k) {
    times.insert(std::upper_bound(times.begin(), times.end(), big[k].second), big[k].second);
    int64_t c = 0, used = 0;
    for (size_t j = k + 1; j-- > 0 && used + big[j].first <= W;) {
      used += big[j].first;
      ++c;
    }
    const int64_t q = (static_cast<int64_t>(times.size()) + c - 1) / c;
    double sum = 0;
    for (int64_t j = 0; j < q; ++j) sum += times[j];
    waves = std::max(waves, sum);
  }
  BoundParts b;
  b.work = W > 0 && speed_sum > 0 ? work / speed_sum : 0;
  b.piece = piece;
  b.waves = waves;
  return b;
}

}  // namespace planner
}  // namespace bytescale
