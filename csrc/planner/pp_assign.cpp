// PP-Balance, steps 1-3 (pp_balance.cpp): level assignment and slot placement: rings (their
// widths, pipelines and ring slots), local bins to pipelines (level-contiguous runs or greedy),
// a pipeline's order of slots, the cohorts rings join.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "planner/peer_budget.h"
#include "planner/pp_balance.h"

namespace bytescale {
namespace planner {
namespace detail {
namespace ppb {

// ---- 1. rings ----------------------------------------------------------------------------------
// ring_target > 0: a ring is made at least wide enough that its stage time stays within
// ring_target (a bin's cost: ring micro-batches no costlier than local ones, so no ring
// magnifies its pipelines' bubble), up to its best ring size.
void PPBalance::split(double T, double ring_target, Layout& L, std::vector<int64_t>& locals) const {
  L.rings.clear();
  locals.clear();
  for (int64_t i : ctx_.order) {
    const int64_t s = ctx_.len[i];
    const double sd = static_cast<double>(s);
    const bool must = s > ctx_.cap_max;
    const double t1 = cm_.seqTime(sd);
    if (!must && (H_ == 1 || P_ * t1 + hops(sd) <= T)) {
      locals.push_back(i);
      continue;
    }
    const int dmin = must ? ctx_.memMin(s).ranks : 2;
    const RingShape sh = ringShape(cm_, sd, dmin, H_);
    int d = minRanksWithin(cm_, sd, sh, (T - hops(sd)) / P_);
    if (d < 0) d = sh.best;
    if (ring_target > 0 && d < sh.best) {
      const int du = minRanksWithin(cm_, sd, sh, ring_target);
      d = du < 0 ? sh.best : std::max(d, du);
    }
    const double c = cm_.shardedTime(sd, d);
    if (!must && c >= t1) {
      locals.push_back(i);
      continue;
    }
    RingItem r;
    r.seq = i;
    r.d = d;
    r.cost = c;
    r.ratio = ctx_.opt.offload ? ratioForRanks(cm_, s, ctx_.cap_min, d) : 0.0;
    L.rings.push_back(std::move(r));
  }
}

void PPBalance::placeRings(Layout& L, std::vector<double>& load, std::vector<double>& cmax) const {
  std::vector<int64_t> nring(H_, 0);
  std::vector<int> idx(H_);
  std::vector<double> after(H_);
  L.ring_of.assign(H_, {});
  for (size_t k = 0; k < L.rings.size(); ++k) {
    RingItem& r = L.rings[k];
    const double ch = chain(r.cost, static_cast<double>(ctx_.len[r.seq]) / r.d);
    for (int h = 0; h < H_; ++h) after[h] = est(load[h] + r.cost, std::max(cmax[h], ch));
    if (ctx_.bounded) {  // peer budget (peer_budget.h): the window of pipelines ending least late
      const int a = bestWindow(after, r.d);
      r.members.resize(r.d);
      std::iota(r.members.begin(), r.members.end(), a);
    } else {
      std::iota(idx.begin(), idx.end(), 0);
      auto cmp = [&](int a, int b) {
        if (after[a] != after[b]) return after[a] < after[b];
        if (nring[a] != nring[b]) return nring[a] > nring[b];  // join an existing cohort
        return a < b;
      };
      std::nth_element(idx.begin(), idx.begin() + (r.d - 1), idx.end(), cmp);
      r.members.assign(idx.begin(), idx.begin() + r.d);
      std::sort(r.members.begin(), r.members.end());
    }
    int64_t slot = 0;
    for (int h : r.members) slot = std::max(slot, nring[h]);
    r.slot = slot;
    for (int h : r.members) {
      nring[h] = slot + 1;
      load[h] += r.cost;
      cmax[h] = std::max(cmax[h], ch);
      L.ring_of[h].push_back(static_cast<int32_t>(k));
    }
  }
}

// ---- 2. level-contiguous runs of local micro-batches --------------------------------------------
// Pipelines visited costliest-chain first; each takes bins (costliest first) while its estimate
// stays within tau. Returns whether every bin found a pipeline; fills owner when asked.
bool PPBalance::fillRuns(const Layout& L, const std::vector<int>& order, const std::vector<double>& load0,
              const std::vector<double>& cmax0, double tau, std::vector<int>* owner) const {
  size_t k = 0;
  const size_t n = L.bins.size();
  for (int h : order) {
    double load = load0[h], cmax = cmax0[h];
    while (k < n) {
      const Bin& b = L.bins[k];
      const double ch = chain(b.cost, static_cast<double>(b.tokens));
      const double e = est(load + b.cost, std::max(cmax, ch));
      if (e > tau) break;
      load += b.cost;
      cmax = std::max(cmax, ch);
      if (owner) (*owner)[k] = h;
      ++k;
    }
    if (k == n) return true;
  }
  return k == n;
}

void PPBalance::assignBins(Layout& L, const std::vector<double>& load, const std::vector<double>& cmax,
                double start, bool runs) const {
  L.bins_of.assign(H_, {});
  if (L.bins.empty()) return;
  if (!runs) {  // each bin, costliest first, to the pipeline whose estimate grows least
    std::vector<double> ld = load, cm = cmax;
    for (size_t k = 0; k < L.bins.size(); ++k) {
      const Bin& b = L.bins[k];
      const double ch = chain(b.cost, static_cast<double>(b.tokens));
      int arg = 0;
      double best = 0;
      for (int h = 0; h < H_; ++h) {
        const double e = est(ld[h] + b.cost, std::max(cm[h], ch));
        if (h == 0 || e < best) {
          best = e;
          arg = h;
        }
      }
      ld[arg] += b.cost;
      cm[arg] = std::max(cm[arg], ch);
      L.bins_of[arg].push_back(static_cast<int32_t>(k));
    }
    return;
  }
  std::vector<int> order(H_);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return cmax[a] != cmax[b] ? cmax[a] > cmax[b] : load[a] > load[b];
  });
  double lo = 0, hi = std::max(start, 1e-300);
  for (int it = 0; it < 200 && !fillRuns(L, order, load, cmax, hi, nullptr); ++it) hi *= 1.5;
  for (int it = 0; it < 40 && hi > lo * (1 + 1e-6); ++it) {
    const double mid = 0.5 * (lo + hi);
    if (fillRuns(L, order, load, cmax, mid, nullptr)) hi = mid;
    else lo = mid;
  }
  std::vector<int> owner(L.bins.size(), -1);
  if (!fillRuns(L, order, load, cmax, hi, &owner))
    throw std::logic_error("pp-balance: the bins found no pipeline");
  for (size_t k = 0; k < owner.size(); ++k) L.bins_of[owner[k]].push_back(static_cast<int32_t>(k));
}

// ---- 3. orders ----------------------------------------------------------------------------------
// The entries of pipeline h: `pre` cheapest bins ascending, the ring region (rings at their
// slots, holes filled with the costliest remaining bins), the rest by `tail` (0: decreasing,
// 1: ascending, 2: organ pipe; 1 and 2 only without rings, where `pre` is 0).
void PPBalance::orderPipeline(Layout& L, int h, int64_t pre, int tail) const {
  std::vector<int32_t> bins = L.bins_of[h];
  std::stable_sort(bins.begin(), bins.end(), [&](int32_t a, int32_t b) { return L.bins[a].cost > L.bins[b].cost; });
  std::vector<Entry>& out = L.lists[h];
  out.clear();
  // the `pre` cheapest, ascending
  const int64_t np = std::min<int64_t>(pre, static_cast<int64_t>(bins.size()));
  int64_t slot = 0;
  for (int64_t j = 0; j < np; ++j) out.push_back({-1, bins[bins.size() - 1 - j], slot++});
  bins.resize(bins.size() - static_cast<size_t>(np));
  size_t front = 0;  // costliest unused bin
  const std::vector<int32_t>& rings = L.ring_of[h];
  if (!rings.empty()) {
    const int64_t region = L.rings[rings.back()].slot + 1;
    size_t ri = 0;
    for (int64_t k = 0; k < region; ++k) {
      if (ri < rings.size() && L.rings[rings[ri]].slot == k) {
        out.push_back({rings[ri++], -1, slot + k});
      } else if (front < bins.size()) {
        out.push_back({-1, bins[front++], slot + k});
      }
    }
    slot += region;
  }
  std::vector<int32_t> rest(bins.begin() + static_cast<std::ptrdiff_t>(front), bins.end());
  if (tail == 1) std::reverse(rest.begin(), rest.end());
  if (tail == 2) {  // ascending, alternate ends: cheap first and last, costly in the middle
    std::vector<int32_t> asc(rest.rbegin(), rest.rend()), a, b;
    for (size_t j = 0; j < asc.size(); ++j) (j % 2 ? b : a).push_back(asc[j]);
    rest = a;
    rest.insert(rest.end(), b.rbegin(), b.rend());
  }
  for (int32_t bn : rest) out.push_back({-1, bn, slot++});
}

// The cohort (pipelines joined by rings) of every pipeline: component ids and member lists.
void PPBalance::cohorts(const Layout& L, std::vector<int>& comp, std::vector<std::vector<int>>& members) const {
  std::vector<int> parent(H_);
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  for (const RingItem& r : L.rings)
    for (size_t j = 1; j < r.members.size(); ++j) {
      const int a = find(r.members[0]), b = find(r.members[j]);
      if (a != b) parent[std::max(a, b)] = std::min(a, b);
    }
  comp.assign(H_, -1);
  members.clear();
  std::vector<int> id(H_, -1);
  for (int h = 0; h < H_; ++h) {
    const int root = find(h);
    if (id[root] < 0) {
      id[root] = static_cast<int>(members.size());
      members.emplace_back();
    }
    comp[h] = id[root];
    members[id[root]].push_back(h);
  }
}

}  // namespace ppb
}  // namespace detail
}  // namespace planner
}  // namespace bytescale
