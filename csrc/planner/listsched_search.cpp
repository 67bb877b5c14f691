// Searches over list schedules (listsched.h): the exhaustive branch and bound, late-acceptance hill
// climbing, best-improvement reinsertion and beam search.
#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner/listsched.h"

namespace bytescale {
namespace planner {
namespace detail {

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
