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
  Context ctx(len, opt);
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

namespace {

// The exhaustive search's state: depth-first over (next sequence, its mix).
struct BranchAndBound {
  const ListModel& M;
  int64_t limit;
  int64_t nodes = 0;
  bool aborted = false;
  double best;
  std::vector<int> best_order, best_mix, order, mix;
  std::vector<int> twin;  // the previous sequence of equal length, -1 if none
  std::vector<std::vector<double>> stack;
  std::vector<std::vector<std::pair<double, std::pair<int, int>>>> kids;  // per depth
  std::vector<std::vector<std::vector<double>>> seen;  // per placed set: profiles explored
  std::vector<std::pair<double, double>> fv;           // (free time, speed) scratch

  BranchAndBound(const ListModel& m, int64_t lim, double incumbent)
      : M(m), limit(lim), best(incumbent) {
    twin.assign(M.n, -1);
    for (int i = 0; i < M.n; ++i)
      for (int j = i - 1; j >= 0; --j)
        if (M.len[j] == M.len[i]) {
          twin[i] = j;
          break;
        }
    stack.assign(M.n + 1, std::vector<double>());
    kids.assign(M.n + 1, {});
    seen.assign(size_t{1} << M.n, {});
    order.assign(M.n, -1);
    mix.assign(M.n, 0);
    M.initProfile(stack[0], nullptr);
  }

  // No completion of this state ends before this: the latest free time, every remaining
  // sequence's earliest end, the remaining least work water-filled over the free times.
  double lowerBound(uint32_t mask, const std::vector<double>& prof) {
    double lb = M.profileMax(prof.data());
    double rem = 0;
    for (int i = 0; i < M.n; ++i) {
      if (mask >> i & 1) continue;
      rem += M.min_work[i];
      double e = kNoHorizon;
      for (const Mix& m : M.mixes[i]) e = std::min(e, M.startOf(m, prof.data()) + m.dur);
      lb = std::max(lb, e);
    }
    if (rem > 0) {
      fv.clear();
      for (int k = 0; k < M.K; ++k)
        for (int j = 0; j < M.count[k]; ++j) fv.emplace_back(prof[M.off[k] + j], M.speed[k]);
      std::sort(fv.begin(), fv.end());
      double v = 0, t = fv[0].first, left = rem;
      size_t j = 0;
      for (;;) {
        while (j < fv.size() && fv[j].first <= t) v += fv[j++].second;
        const double next = j < fv.size() ? fv[j].first : kNoHorizon;
        if (left <= v * (next - t)) {
          t += left / v;
          break;
        }
        left -= v * (next - t);
        t = next;
      }
      lb = std::max(lb, t);
    }
    return lb;
  }

  // A state whose free times are elementwise no earlier than an explored one's, with the same
  // sequences placed, cannot do better (list schedules are monotone in the free times).
  bool dominated(uint32_t mask, const std::vector<double>& prof) {
    auto& list = seen[mask];
    for (const auto& q : list) {
      bool le = true;
      for (int r = 0; r < M.W && le; ++r) le = q[r] <= prof[r];
      if (le) return true;
    }
    if (list.size() < 512) list.push_back(prof);
    return false;
  }

  void dfs(int depth, uint32_t mask) {
    if (aborted) return;
    if (++nodes > limit) {
      aborted = true;
      return;
    }
    const std::vector<double>& prof = stack[depth];
    if (depth == M.n) {
      const double mx = M.profileMax(prof.data());
      if (mx < best * (1 - 1e-12)) {
        best = mx;
        best_order = order;
        best_mix = mix;
      }
      return;
    }
    if (lowerBound(mask, prof) >= best * (1 - 1e-12)) return;
    if (depth > 0 && dominated(mask, prof)) return;
    // children by their end, earliest first
    auto& ks = kids[depth];
    ks.clear();
    for (int i = 0; i < M.n; ++i) {
      if (mask >> i & 1) continue;
      if (twin[i] >= 0 && !(mask >> twin[i] & 1)) continue;  // equal sequences in input order
      for (size_t j = 0; j < M.mixes[i].size(); ++j) {
        const Mix& m = M.mixes[i][j];
        const double end = M.startOf(m, prof.data()) + m.dur;
        if (end < best * (1 - 1e-12)) ks.push_back({end, {i, static_cast<int>(j)}});
      }
    }
    std::sort(ks.begin(), ks.end());
    std::vector<double>& next = stack[depth + 1];
    for (size_t c = 0; c < ks.size(); ++c) {
      const int i = ks[c].second.first, j = ks[c].second.second;
      if (ks[c].first >= best * (1 - 1e-12)) break;
      next = prof;
      M.place(M.mixes[i][j], next.data(), nullptr, nullptr);
      order[depth] = i;
      mix[i] = j;
      dfs(depth + 1, mask | (1u << i));
      if (aborted) return;
    }
  }
};

}  // namespace

SearchResult branchAndBound(const ListModel& M, double incumbent, int64_t node_limit,
                            std::vector<int>& order, std::vector<int>& mix) {
  if (M.n > kMaxSearchSequences)
    throw std::invalid_argument("list schedules: the exhaustive search takes at most " +
                                std::to_string(kMaxSearchSequences) + " sequences, got " +
                                std::to_string(M.n));
  BranchAndBound bb(M, node_limit, incumbent);
  bb.dfs(0, 0);
  SearchResult r;
  r.nodes = bb.nodes;
  r.complete = !bb.aborted;
  r.improved = !bb.best_order.empty();
  r.step = bb.best;
  if (r.improved) {
    order = bb.best_order;
    mix = bb.best_mix;
  }
  return r;
}

double lateAcceptance(const ListModel& M, std::vector<int>& order, std::vector<int>& mix,
                      double horizon, int64_t evals, std::mt19937_64& rng, int64_t& used) {
  const int n = M.n, W = M.W;
  std::vector<double> prof_at(static_cast<size_t>(n + 1) * W, 0.0), max_at(n + 1, 0.0);
  double cur = M.evaluate(order, mix, horizon, 0, prof_at, max_at);
  ++used;
  double best = cur;
  std::vector<int> best_order = order, best_mix = mix;
  bool movable = n > 1;
  for (int i = 0; i < n && !movable; ++i) movable = M.mixes[i].size() > 1;
  if (!movable) return best;
  constexpr int kHistory = 64;
  std::vector<double> hist(kHistory, cur);
  int valid = n;  // prof_at[0 .. valid] belongs to the current solution
  std::vector<int> prev_order, prev_mix;
  auto random_mix = [&](int i, int old) {
    const int nm = static_cast<int>(M.mixes[i].size());
    const uint64_t x = rng() % 8;
    int j;
    if (x == 0) j = -1;
    else if (x < 4 && old >= 0) j = std::clamp(old + (rng() % 2 ? 1 : -1), 0, nm - 1);
    else j = static_cast<int>(rng() % nm);
    if (j == old) j = j + 1 < nm ? j + 1 : -1;
    return j;
  };
  for (int64_t it = 0; it < evals; ++it) {
    prev_order = order;
    prev_mix = mix;
    const int kind = static_cast<int>(rng() % 10);
    int a = static_cast<int>(rng() % n), b = static_cast<int>(rng() % n);
    int from, at;  // the first position changed; the position of the sequence moved or changed
    if (kind < 6 && n > 1) {
      if (a == b) b = (a + 1) % n;
      if (kind < 4) {  // insert: the sequence at position a moves to position b
        const int v = order[a];
        if (a < b) std::move(order.begin() + a + 1, order.begin() + b + 1, order.begin() + a);
        else std::move_backward(order.begin() + b, order.begin() + a, order.begin() + a + 1);
        order[b] = v;
        at = b;
        if (rng() % 3 == 0 && M.mixes[v].size() > 1) mix[v] = random_mix(v, mix[v]);
      } else {  // swap
        std::swap(order[a], order[b]);
        at = std::max(a, b);
      }
      from = std::min(a, b);
    } else {  // another mix (or -1: chosen on the way) for the sequence at position a
      const int i = order[a];
      if (M.mixes[i].size() <= 1) continue;
      mix[i] = random_mix(i, mix[i]);
      from = at = a;
    }
    if (rng() % 4 == 0)  // and the later sequences' mixes open: chosen on the way again
      for (int p = at + 1; p < n; ++p) mix[order[p]] = -1;
    const int start = std::min(from, valid);
    const double cand = M.evaluate(order, mix, horizon, start, prof_at, max_at);
    ++used;
    const int v = static_cast<int>(it % kHistory);
    if (cand <= cur || cand <= hist[v]) {
      cur = cand;
      valid = n;
      if (cand < best * (1 - 1e-12)) {
        best = cand;
        best_order = order;
        best_mix = mix;
      }
    } else {
      valid = start;
      order.swap(prev_order);
      mix.swap(prev_mix);
    }
    if (cur < hist[v]) hist[v] = cur;
  }
  order = best_order;
  mix = best_mix;
  return best;
}

double reinsertDescent(const ListModel& M, std::vector<int>& order, std::vector<int>& mix,
                       double horizon, int64_t evals, int64_t& used) {
  const int n = M.n, W = M.W;
  // base: the profiles along `order`; scratch: a candidate's, from its first changed position on
  std::vector<double> base(static_cast<size_t>(n + 1) * W, 0.0), base_max(n + 1, 0.0);
  std::vector<double> scratch(base.size(), 0.0), scratch_max(n + 1, 0.0);
  M.fix(order, mix, horizon);
  double cur = M.evaluate(order, mix, horizon, 0, base, base_max);
  ++used;
  int64_t left = evals;
  std::vector<int> cand_order(n), cand_mix, best_order, best_mix;
  bool improved = true;
  while (improved && left > 0) {
    improved = false;
    for (int q = n - 1; q >= 0 && left > 0; --q) {  // the sequence now at position q
      const int v = order[q];
      double best = cur * (1 - 1e-12);
      best_order.clear();
      for (int p = 0; p < n && left > 0; ++p) {
        for (int k = 0, j = 0; k < n; ++k) {  // v at position p, the others in their order
          if (k == p) {
            cand_order[k] = v;
            continue;
          }
          if (order[j] == v) ++j;
          cand_order[k] = order[j++];
        }
        const int from = std::min(p, q);  // positions before it are unchanged
        for (int m = -1; m < static_cast<int>(M.mixes[v].size()) && left > 0; ++m) {
          for (int tail = 0; tail < 2 && left > 0; ++tail) {
            if (!tail && m == mix[v] && p == q) continue;  // the current schedule
            cand_mix = mix;
            cand_mix[v] = m;
            if (tail)  // the later sequences' mixes open too
              for (int k = p + 1; k < n; ++k) cand_mix[cand_order[k]] = -1;
            std::copy(base.begin() + static_cast<size_t>(from) * W,
                      base.begin() + static_cast<size_t>(from + 1) * W,
                      scratch.begin() + static_cast<size_t>(from) * W);
            scratch_max[from] = base_max[from];
            const double step = M.evaluate(cand_order, cand_mix, horizon, from, scratch, scratch_max);
            ++used;
            --left;
            if (step < best) {
              best = step;
              best_order = cand_order;
              best_mix = cand_mix;
            }
          }
        }
      }
      if (!best_order.empty()) {
        order = best_order;
        mix = best_mix;
        M.fix(order, mix, horizon);
        cur = M.evaluate(order, mix, horizon, 0, base, base_max);
        ++used;
        improved = true;
      }
    }
  }
  return cur;
}

double beamSearch(const ListModel& M, int64_t placements, std::vector<int>& order,
                  std::vector<int>& mix, int64_t& used) {
  const int n = M.n, W = M.W;
  if (n == 0) {
    order.clear();
    mix.clear();
    return 0;
  }
  // equal sequences are placed in input order (the others are symmetric to it)
  std::vector<int> twin(n, -1);
  {
    std::map<int64_t, int> last;
    for (int i = 0; i < n; ++i) {
      auto it = last.find(M.len[i]);
      if (it != last.end()) twin[i] = it->second;
      last[M.len[i]] = i;
    }
  }
  double children = 0;
  for (int i = 0; i < n; ++i) children += static_cast<double>(M.mixes[i].size());
  const int width = static_cast<int>(std::clamp(placements / std::max(1.0, n * children), 1.0, 256.0));
  struct State {
    std::vector<double> prof;
    std::vector<int> order, mix;
    std::vector<char> placed;
    double rem = 0;  // the remaining sequences' least work
    double key = 0;  // no completion ends before it
  };
  std::vector<double> speed_at(W);
  for (int k = 0; k < M.K; ++k)
    for (int j = 0; j < M.count[k]; ++j) speed_at[M.off[k] + j] = M.speed[k];
  std::vector<std::pair<double, double>> fv(W);
  // max(the latest free time, the remaining work water-filled over the free times)
  auto key_of = [&](const std::vector<double>& prof, double rem) {
    double mx = M.profileMax(prof.data());
    if (rem <= 0) return mx;
    for (int r = 0; r < W; ++r) fv[r] = {prof[r], speed_at[r]};
    std::sort(fv.begin(), fv.end());
    double v = 0, t = fv[0].first, left = rem;
    int j = 0;
    for (;;) {
      while (j < W && fv[j].first <= t) v += fv[j++].second;
      const double next = j < W ? fv[j].first : kNoHorizon;
      if (left <= v * (next - t)) return std::max(mx, t + left / v);
      left -= v * (next - t);
      t = next;
    }
  };
  std::vector<State> beam(1), next;
  M.initProfile(beam[0].prof, nullptr);
  beam[0].mix.assign(n, 0);
  beam[0].placed.assign(n, 0);
  for (int i = 0; i < n; ++i) beam[0].rem += M.min_work[i];
  std::vector<std::pair<double, std::pair<int, std::pair<int, int>>>> cand;  // key, (state, (i, mix))
  std::vector<double> prof;
  for (int depth = 0; depth < n; ++depth) {
    cand.clear();
    for (int b = 0; b < static_cast<int>(beam.size()); ++b) {
      const State& st = beam[b];
      for (int i = 0; i < n; ++i) {
        if (st.placed[i] || (twin[i] >= 0 && !st.placed[twin[i]])) continue;
        for (int j = 0; j < static_cast<int>(M.mixes[i].size()); ++j) {
          prof = st.prof;
          M.place(M.mixes[i][j], prof.data(), nullptr, nullptr);
          ++used;
          cand.push_back({key_of(prof, st.rem - M.min_work[i]), {b, {i, j}}});
        }
      }
    }
    const size_t keep = std::min(cand.size(), static_cast<size_t>(width));
    std::partial_sort(cand.begin(), cand.begin() + keep, cand.end());
    next.resize(keep);
    for (size_t c = 0; c < keep; ++c) {
      const State& from = beam[cand[c].second.first];
      const int i = cand[c].second.second.first, j = cand[c].second.second.second;
      State& st = next[c];
      st.prof = from.prof;
      M.place(M.mixes[i][j], st.prof.data(), nullptr, nullptr);
      st.order = from.order;
      st.order.push_back(i);
      st.mix = from.mix;
      st.mix[i] = j;
      st.placed = from.placed;
      st.placed[i] = 1;
      st.rem = from.rem - M.min_work[i];
      st.key = cand[c].first;
    }
    beam.swap(next);
  }
  int arg = 0;
  for (int b = 1; b < static_cast<int>(beam.size()); ++b)
    if (M.profileMax(beam[b].prof.data()) < M.profileMax(beam[arg].prof.data())) arg = b;
  order = beam[arg].order;
  mix = beam[arg].mix;
  return M.profileMax(beam[arg].prof.data());
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
