// List schedules: the model (rank classes, mixes, profiles), one list schedule, its plan (listsched.h).
#include "planner/listsched.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

#include "planner/bound.h"
#include "planner/builder.h"
#include "planner/offload_rule.h"
#include "planner/replay.h"

namespace bytescale {
namespace planner {
namespace detail {

double ListModel::mixCount(const PlanOptions& o) {
  std::map<std::pair<double, int64_t>, int> cls;
  for (int r = 0; r < o.world_size; ++r) ++cls[{speedOf(o, r), rankCapacity(o, r)}];
  double combos = 1;
  for (auto& [key, c] : cls) combos *= c + 1;
  return combos - 1;
}

ListModel::ListModel(const std::vector<int64_t>& lengths, const PlanOptions& o, size_t max_mixes)
    : opt(o), len(lengths), W(o.world_size), n(static_cast<int>(lengths.size())) {
  std::map<std::pair<double, int64_t>, std::vector<int>> cls;
  for (int r = 0; r < W; ++r) cls[{speedOf(o, r), rankCapacity(o, r)}].push_back(r);
  for (auto& [key, rs] : cls) {
    off.push_back(ranks.empty() ? 0 : off.back() + count.back());
    count.push_back(static_cast<int>(rs.size()));
    speed.push_back(key.first);
    cap.push_back(key.second);
    ranks.push_back(rs);
  }
  K = static_cast<int>(ranks.size());
  const double combos = mixCount(o);
  if (combos > static_cast<double>(max_mixes))
    throw std::invalid_argument("list schedules: " + std::to_string(K) + " rank classes allow " +
                                std::to_string(static_cast<int64_t>(combos)) +
                                " mixes per sequence, more than " + std::to_string(max_mixes));
  const CostModel& cm = o.cost;
  mixes.resize(n);
  min_work.assign(n, kNoHorizon);
  std::vector<int> c(K, 0);
  std::vector<Mix> all;
  std::map<int64_t, int> first_of_length;  // equal lengths share their mixes
  for (int i = 0; i < n; ++i) {
    const int64_t s = len[i];
    auto seen = first_of_length.find(s);
    if (seen != first_of_length.end()) {
      mixes[i] = mixes[seen->second];
      min_work[i] = min_work[seen->second];
      continue;
    }
    first_of_length.emplace(s, i);
    if (K == 1) {  // one class: the ring sizes whose time beats every smaller size's
      std::vector<Mix>& kept = mixes[i];
      double best = kNoHorizon;
      const int dmin = offloadFloor(o, s, cap[0]).ranks;
      for (int d = 1; d <= W; ++d) {
        if (d == 1 ? s > cap[0] : d < dmin) continue;
        Mix m;
        m.dur = (d == 1 ? cm.seqTime(static_cast<double>(s)) : cm.shardedTime(static_cast<double>(s), d)) / speed[0];
        if (!std::isfinite(m.dur) || m.dur >= best) continue;
        best = m.dur;
        m.c.assign(1, d);
        m.d = d;
        m.ratio = d > 1 && o.offload ? ratioForRanks(cm, s, cap[0], d) : 0.0;
        m.work = m.dur * d * speed[0];
        kept.push_back(std::move(m));
      }
      std::reverse(kept.begin(), kept.end());  // by duration
      if (kept.empty())
        throw std::invalid_argument("list schedules: sequence " + std::to_string(i) + " of " +
                                    std::to_string(s) + " tokens fits no set of ranks");
      for (const Mix& m : kept) min_work[i] = std::min(min_work[i], m.work);
      continue;
    }
    all.clear();
    std::fill(c.begin(), c.end(), 0);
    for (;;) {
      int k = 0;  // next mix (mixed radix)
      while (k < K && c[k] == count[k]) c[k++] = 0;
      if (k == K) break;
      ++c[k];
      int d = 0;
      double vmin = kNoHorizon, vsum = 0;
      int64_t cmin = std::numeric_limits<int64_t>::max();
      for (int q = 0; q < K; ++q)
        if (c[q]) {
          d += c[q];
          vmin = std::min(vmin, speed[q]);
          vsum += c[q] * speed[q];
          cmin = std::min(cmin, cap[q]);
        }
      Mix m;
      if (d == 1) {
        if (s > cmin) continue;
        m.dur = cm.seqTime(static_cast<double>(s)) / vmin;
      } else {
        const int dmin = offloadFloor(o, s, cmin).ranks;
        if (d < dmin) continue;
        m.dur = cm.shardedTime(static_cast<double>(s), d) / vmin;
        m.ratio = o.offload ? ratioForRanks(cm, s, cmin, d) : 0.0;
      }
      if (!std::isfinite(m.dur)) continue;
      m.c = c;
      m.d = d;
      m.work = m.dur * vsum;
      all.push_back(std::move(m));
    }
    std::stable_sort(all.begin(), all.end(), [](const Mix& a, const Mix& b) {
      return a.dur != b.dur ? a.dur < b.dur : a.d < b.d;
    });
    // Keep a mix unless a kept one (no longer) uses a sub-multiset of its ranks.
    std::vector<Mix>& kept = mixes[i];
    for (Mix& m : all) {
      bool dominated = false;
      for (const Mix& a : kept) {
        bool sub = true;
        for (int q = 0; q < K && sub; ++q) sub = a.c[q] <= m.c[q];
        if (sub) {
          dominated = true;
          break;
        }
      }
      if (!dominated) kept.push_back(std::move(m));
    }
    if (kept.empty())
      throw std::invalid_argument("list schedules: sequence " + std::to_string(i) + " of " +
                                  std::to_string(s) + " tokens fits no set of ranks");
    for (const Mix& m : kept) min_work[i] = std::min(min_work[i], m.work);
  }
}

void ListModel::initProfile(std::vector<double>& prof, std::vector<int>* ids) const {
  prof.assign(W, 0.0);
  if (ids) {
    ids->assign(W, 0);
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < count[k]; ++j) (*ids)[off[k] + j] = ranks[k][j];
  }
}

double ListModel::startOf(const Mix& m, const double* prof) const {
  double st = 0;
  for (int k = 0; k < K; ++k)
    if (m.c[k]) st = std::max(st, prof[off[k] + m.c[k] - 1]);
  return st;
}

double ListModel::place(const Mix& m, double* prof, int* ids, std::vector<int>* members) const {
  const double end = startOf(m, prof) + m.dur;
  std::vector<int> moved;
  for (int k = 0; k < K; ++k) {
    const int c = m.c[k];
    if (!c) continue;
    double* seg = prof + off[k];
    const int cnt = count[k];
    // the c earliest become `end`: shift the ones free before `end` down, then fill
    const int p = static_cast<int>(std::upper_bound(seg + c, seg + cnt, end) - seg);
    if (ids) {
      int* is = ids + off[k];
      if (members) members->insert(members->end(), is, is + c);
      moved.assign(is, is + c);
      std::move(is + c, is + p, is);
      std::copy(moved.begin(), moved.end(), is + (p - c));
    }
    std::move(seg + c, seg + p, seg);
    std::fill(seg + (p - c), seg + p, end);
  }
  return end;
}

double ListModel::profileMax(const double* prof) const {
  double mx = 0;
  for (int k = 0; k < K; ++k)
    if (count[k]) mx = std::max(mx, prof[off[k] + count[k] - 1]);
  return mx;
}

int ListModel::choose(int i, const std::vector<int>& mix, const double* prof, double horizon) const {
  if (mix[i] >= 0) return mix[i];
  const std::vector<Mix>& ms = mixes[i];
  int first = 0, fit = -1;
  double first_end = kNoHorizon;
  for (size_t j = 0; j < ms.size(); ++j) {
    const Mix& m = ms[j];
    const double e = startOf(m, prof) + m.dur;
    if (e <= horizon && horizon < kNoHorizon && (fit < 0 || m.work < ms[fit].work * (1 - 1e-12))) fit = static_cast<int>(j);
    if (e < first_end * (1 - 1e-12) ||
        (e <= first_end * (1 + 1e-12) && m.work < ms[first].work * (1 - 1e-12))) {
      first_end = std::min(first_end, e);
      first = static_cast<int>(j);
    }
  }
  return fit >= 0 ? fit : first;
}

double ListModel::evaluate(const std::vector<int>& order, const std::vector<int>& mix,
                           double horizon, int from, std::vector<double>& prof_at,
                           std::vector<double>& max_at) const {
  double mx = max_at[from];
  for (int pos = from; pos < n; ++pos) {
    const double* cur = prof_at.data() + static_cast<size_t>(pos) * W;
    double* nxt = prof_at.data() + static_cast<size_t>(pos + 1) * W;
    std::copy(cur, cur + W, nxt);
    const int i = order[pos];
    mx = std::max(mx, place(mixes[i][choose(i, mix, cur, horizon)], nxt, nullptr, nullptr));
    max_at[pos + 1] = mx;
  }
  return mx;
}

double ListModel::step(const std::vector<int>& order, const std::vector<int>& mix,
                       double horizon) const {
  std::vector<double> prof;
  initProfile(prof, nullptr);
  double mx = 0;
  for (int i : order) mx = std::max(mx, place(mixes[i][choose(i, mix, prof.data(), horizon)], prof.data(), nullptr, nullptr));
  return mx;
}

void ListModel::fix(const std::vector<int>& order, std::vector<int>& mix, double horizon) const {
  std::vector<double> prof;
  initProfile(prof, nullptr);
  for (int i : order) {
    mix[i] = choose(i, mix, prof.data(), horizon);
    place(mixes[i][mix[i]], prof.data(), nullptr, nullptr);
  }
}

Plan ListModel::build(const std::vector<int>& order, const std::vector<int>& mix, double horizon,
                      const char* name) const {
  // A list schedule takes any members: a plan of the unbounded problem (PlanOptions::peer_budget
  // ignored; refineSmall does not run under a binding budget).
  PlanOptions unbounded = opt;
  unbounded.peer_budget = 0;
  Context ctx(len, unbounded);
  Builder b(ctx);
  std::vector<double> prof;
  std::vector<int> ids, members;
  initProfile(prof, &ids);
  // A rank's consecutive local sequences share capacity-sized micro-batches (their costs add up,
  // so the step does not change); they are flushed before the rank's next ring.
  std::vector<std::vector<int64_t>> pending(W);
  auto flush = [&](int r) {
    std::vector<int64_t>& q = pending[r];
    if (q.empty()) return;
    std::stable_sort(q.begin(), q.end(), [&](int64_t a, int64_t c) { return len[a] > len[c]; });
    b.packLocal(r, q.data(), q.size());
    q.clear();
  };
  for (int i : order) {
    const Mix& m = mixes[i][choose(i, mix, prof.data(), horizon)];
    members.clear();
    place(m, prof.data(), ids.data(), &members);
    if (m.d == 1) {
      pending[members[0]].push_back(i);
      continue;
    }
    for (int r : members) flush(r);
    b.appendRing(i, members, m.ratio, m.dur);
  }
  for (int r = 0; r < W; ++r) flush(r);
  Plan p = b.finish(lowerBound(len, opt));
  p.strategy = name;
  return p;
}

bool ListModel::fromPlan(const Plan& p, std::vector<int>& order, std::vector<int>& mix) const {
  if (p.world_size != W || p.num_sequences != n) return false;
  ReplayResult rep = replay(p);
  std::vector<int> cls_of(W);
  for (int k = 0; k < K; ++k)
    for (int r : ranks[k]) cls_of[r] = k;
  std::vector<double> start(n, kNoHorizon), dur(n, 0);
  std::vector<int> used(static_cast<size_t>(n) * K, 0);
  for (int r = 0; r < W; ++r)
    for (int64_t mb = p.rank_mb[r]; mb < p.rank_mb[r + 1]; ++mb) {
      double t = rep.mb_start[mb];
      for (int64_t sg = p.mb_seg[mb]; sg < p.mb_seg[mb + 1]; ++sg) {
        const int64_t i = p.seg_seq[sg];
        if (i < 0 || i >= n) return false;
        ++used[static_cast<size_t>(i) * K + cls_of[r]];
        if (p.mb_ring[mb] >= 0) {
          start[i] = std::min(start[i], t);
          dur[i] = std::max(dur[i], rep.mb_end[mb] - rep.mb_start[mb]);
        } else {  // the sequences of a local micro-batch run one after another
          const double d = opt.cost.seqTime(static_cast<double>(len[i])) / speedOf(opt, r);
          start[i] = t;
          dur[i] = d;
          t += d;
        }
      }
    }
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return start[a] < start[b]; });
  mix.assign(n, -1);
  for (int i = 0; i < n; ++i) {
    for (size_t j = 0; j < mixes[i].size() && mix[i] < 0; ++j) {
      const Mix& m = mixes[i][j];
      bool sub = m.dur <= dur[i] * (1 + 1e-9);
      for (int k = 0; k < K && sub; ++k) sub = m.c[k] <= used[static_cast<size_t>(i) * K + k];
      if (sub) mix[i] = static_cast<int>(j);
    }
    if (mix[i] < 0) return false;
  }
  return true;
}

std::vector<int> ListModel::longestFirst() const {
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return len[a] > len[b]; });
  return order;
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
