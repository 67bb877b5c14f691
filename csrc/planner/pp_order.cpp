// PP-Balance, the replay-facing parts (pp_balance.cpp): a layout's pipelines replayed in 1F1B
// (pipeline.h), the best order of a cohort by its replay, the balance step (4.) and its bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "common/zigzag.h"
#include "planner/pp_balance.h"

namespace bytescale {
namespace planner {
namespace detail {
namespace ppb {

// Replays pipelines `pipes` (every member of their rings among them) of layout L; writes
// L.finish for them and returns their latest finish.
double PPBalance::evaluate(Layout& L, const std::vector<int>& pipes) {
  Scratch& w = scratch_;
  w.local.assign(H_, -1);
  for (size_t i = 0; i < pipes.size(); ++i) w.local[pipes[i]] = static_cast<int>(i);
  const int n = static_cast<int>(pipes.size());
  // the cohort's rings, numbered in increasing ring index
  w.ring_id.assign(L.rings.size(), -1);
  w.ring_by_id.clear();
  for (int h : pipes)
    for (const Entry& e : L.lists[h])
      if (e.ring >= 0 && w.ring_id[e.ring] < 0) {
        w.ring_id[e.ring] = 0;
        w.ring_by_id.push_back(e.ring);
      }
  std::sort(w.ring_by_id.begin(), w.ring_by_id.end());
  w.ring_grp.assign(1, 0);
  w.grp.clear();
  for (size_t id = 0; id < w.ring_by_id.size(); ++id) {
    const int32_t r = w.ring_by_id[id];
    w.ring_id[r] = static_cast<int64_t>(id);
    for (int m : L.rings[r].members) {
      if (w.local[m] < 0) throw std::logic_error("pp-balance: a cohort's ring has a member outside it");
      w.grp.push_back(w.local[m]);
    }
    w.ring_grp.push_back(static_cast<int64_t>(w.grp.size()));
  }
  clearOps(w);
  for (int h : pipes) {
    for (const Entry& e : L.lists[h]) pushOp(w, L, e, h, e.ring >= 0 ? w.ring_id[e.ring] : -1);
    w.rank_mb.push_back(static_cast<int64_t>(w.mb_ring.size()));
  }
  PipelineView v;
  v.sched.world_size = n;
  v.sched.rank_mb = w.rank_mb.data();
  v.sched.num_mb = static_cast<int64_t>(w.mb_ring.size());
  v.sched.mb_ring = w.mb_ring.data();
  v.sched.num_rings = static_cast<int64_t>(w.ring_by_id.size());
  v.sched.ring_grp = w.ring_grp.data();
  v.sched.grp_ranks = w.grp.data();
  v.sched.num_grp_ranks = static_cast<int64_t>(w.grp.size());
  v.stages = P_;
  v.mb_slot = w.mb_slot.data();
  // the layouts are well-formed by construction (the plan built from the winner is replayed
  // with every check in finishPipeline and Plan::verify)
  replayPipelineInto(v, w.f.data(), w.b.data(), w.p2p.data(), v.sched.num_mb, w.rep, w.replay, false);
  ++work_.replays;
  work_.replayed_ops += v.sched.num_mb * P_;
  if (n > 1) cohort_ops_ += v.sched.num_mb * P_;
  double mx = 0;
  for (int i = 0; i < n; ++i) {
    L.finish[pipes[i]] = w.rep.pipe_finish[i];
    mx = std::max(mx, w.rep.pipe_finish[i]);
  }
  return mx;
}

// The replay input of the scratch: emptied, then one micro-batch of pipeline h at a time (its
// stage durations, its transfer, its slot; `ring` the replay's ring id, or -1).
void PPBalance::clearOps(Scratch& w) {
  w.rank_mb.assign(1, 0);
  w.mb_ring.clear();
  w.mb_slot.clear();
  w.f.clear();
  w.b.clear();
  w.p2p.clear();
}

void PPBalance::pushOp(Scratch& w, const Layout& L, const Entry& e, int h, int64_t ring) const {
  double c, tokens;
  if (e.ring >= 0) {
    const RingItem& r = L.rings[e.ring];
    const int pos = static_cast<int>(std::lower_bound(r.members.begin(), r.members.end(), h) - r.members.begin());
    c = r.cost;
    tokens = static_cast<double>(zigzag::local_tokens(ctx_.len[r.seq], r.d, pos));
  } else {
    c = L.bins[e.bin].cost;
    tokens = static_cast<double>(L.bins[e.bin].tokens);
  }
  w.mb_ring.push_back(ring);
  w.mb_slot.push_back(e.slot);
  w.p2p.push_back(P_ > 1 ? po_.p2pTime(tokens) : 0.0);
  const double fc = po_.fwd_share * c, bc = c - po_.fwd_share * c;
  for (int q = 0; q < P_; ++q) {
    w.f.push_back(fc);
    w.b.push_back(bc);
  }
}

// Pipeline h's step on its own: its rings as if local (their partners never late). Every
// operation of the cohort's replay starts no earlier (waiting only delays), so it is a lower
// bound of h's finish there.
double PPBalance::alone(const Layout& L, int h) {
  Scratch& w = scratch_;
  clearOps(w);
  for (const Entry& e : L.lists[h]) pushOp(w, L, e, h, -1);  // its rings as if local
  w.rank_mb.push_back(static_cast<int64_t>(w.mb_ring.size()));
  w.ring_grp.assign(1, 0);
  PipelineView v;
  v.sched.world_size = 1;
  v.sched.rank_mb = w.rank_mb.data();
  v.sched.num_mb = static_cast<int64_t>(w.mb_ring.size());
  v.sched.mb_ring = w.mb_ring.data();
  v.sched.num_rings = 0;
  v.sched.ring_grp = w.ring_grp.data();
  v.sched.grp_ranks = w.grp.data();
  v.sched.num_grp_ranks = 0;
  v.stages = P_;
  v.mb_slot = w.mb_slot.data();
  replayPipelineInto(v, w.f.data(), w.b.data(), w.p2p.data(), v.sched.num_mb, w.rep, w.replay, false);
  ++work_.bounds;
  work_.bound_ops += v.sched.num_mb * P_;
  return w.rep.step_time;
}

// Orders one cohort (or one ring-free pipeline) by the best candidate; returns its latest finish.
// With a threshold (a trial move of the balance step, `changed` its pipelines in this cohort),
// a candidate order whose changed pipelines alone already end at or after it is not replayed
// (its step could not be below the threshold); when no candidate is replayed, returns +inf with
// L's lists and finish times of `pipes` left for the caller to restore.
double PPBalance::orderCohort(Layout& L, const std::vector<int>& pipes,
                   double threshold,
                   const std::vector<int>& changed) {
  bool rings = false;
  int64_t half = -1;
  for (int h : pipes) {
    rings |= !L.ring_of[h].empty();
    const int64_t holes = L.ring_of[h].empty() ? 0
        : L.rings[L.ring_of[h].back()].slot + 1 - static_cast<int64_t>(L.ring_of[h].size());
    const int64_t free_bins = std::max<int64_t>(0, static_cast<int64_t>(L.bins_of[h].size()) - holes);
    half = half < 0 ? free_bins / 2 : std::min(half, free_bins / 2);
  }
  struct Cand {
    int64_t pre;
    int tail;
  };
  std::vector<Cand> cands;
  if (rings) {
    cands = {{0, 0}, {std::max<int64_t>(half, 0), 0}};
    if (half > 1) cands.push_back({half / 2, 0});
  } else {
    cands = {{0, 2}, {0, 0}, {0, 1}};
  }
  double best = -1;
  size_t arg = 0, last = 0;
  const bool prune = std::isfinite(threshold) && pipes.size() > 1;
  for (size_t c = 0; c < cands.size(); ++c) {
    if (c > 0 && cands[c].pre == cands[c - 1].pre && cands[c].tail == cands[c - 1].tail) continue;
    for (int h : pipes) orderPipeline(L, h, cands[c].pre, cands[c].tail);
    last = c;  // the order L holds
    if (prune) {
      bool hopeless = false;
      for (int h : changed) hopeless = hopeless || alone(L, h) >= threshold;
      if (hopeless) continue;
    }
    const double t = evaluate(L, pipes);
    if (best < 0 || t < best * (1 - 1e-12)) {
      best = t;
      arg = c;
      if (c + 1 < cands.size()) {  // kept for the end (no second replay of the winner)
        best_lists_.resize(pipes.size());
        best_finish_.resize(pipes.size());
        for (size_t i = 0; i < pipes.size(); ++i) {
          best_lists_[i] = L.lists[pipes[i]];
          best_finish_[i] = L.finish[pipes[i]];
        }
      }
    }
  }
  if (best < 0) return std::numeric_limits<double>::infinity();
  if (arg != last)
    for (size_t i = 0; i < pipes.size(); ++i) {
      L.lists[pipes[i]].swap(best_lists_[i]);
      L.finish[pipes[i]] = best_finish_[i];
    }
  return best;
}

// ---- 4. balance ---------------------------------------------------------------------------------
// Moves a local micro-batch from the pipeline that ends last to one of the pipelines ending first,
// or swaps one for a cheaper one of theirs, while that shortens the later of the two (cohorts
// re-ordered and replayed).
void PPBalance::balance(Layout& L, const std::vector<int>& comp, const std::vector<std::vector<int>>& members) {
  const int max_moves = 4 * H_ + 16;
  std::vector<int> pipes;
  struct Change {
    double delta;
    int32_t give, take;  // the donor's bin, the receiver's bin (-1: a move)
  };
  // The work bound (kBalanceReplays): cohort replays worth that many replays of the layout.
  const int64_t budget_end = cohort_ops_ + std::max(kBalanceReplays * layoutOps(L), kBalanceFloorOps);
  for (int move = 0; move < max_moves; ++move) {
    if (cohort_ops_ >= budget_end) return;
    int donor = 0;
    for (int h = 1; h < H_; ++h)
      if (L.finish[h] > L.finish[donor]) donor = h;
    if (L.bins_of[donor].empty()) return;
    std::vector<int> recv(H_);
    std::iota(recv.begin(), recv.end(), 0);
    std::stable_sort(recv.begin(), recv.end(), [&](int a, int b) { return L.finish[a] < L.finish[b]; });
    bool improved = false;
    for (int ri = 0; ri < std::min(H_, 4) && !improved; ++ri) {
      const int to = recv[ri];
      if (to == donor) continue;
      const double gap = L.finish[donor] - L.finish[to];
      if (gap <= L.finish[donor] * 1e-9) break;
      std::vector<Change> changes;
      for (int32_t g : L.bins_of[donor]) {
        const double c = L.bins[g].cost;
        if (c < gap) changes.push_back({c, g, -1});
        for (int32_t t : L.bins_of[to]) {
          const double d = c - L.bins[t].cost;
          if (d > 0 && d < gap) changes.push_back({d, g, t});
        }
      }
      std::stable_sort(changes.begin(), changes.end(), [&](const Change& a, const Change& b) {
        return std::abs(a.delta - gap / 2) < std::abs(b.delta - gap / 2);
      });
      if (changes.size() > 4) changes.resize(4);
      pipes = members[comp[donor]];
      if (comp[to] != comp[donor]) pipes.insert(pipes.end(), members[comp[to]].begin(), members[comp[to]].end());
      double before = 0;
      std::vector<std::vector<Entry>> saved_lists;
      std::vector<double> saved_finish;
      for (int h : pipes) {
        before = std::max(before, L.finish[h]);
        saved_lists.push_back(L.lists[h]);
        saved_finish.push_back(L.finish[h]);
      }
      const std::vector<int32_t> db0 = L.bins_of[donor], tb0 = L.bins_of[to];
      for (const Change& ch : changes) {
        if (cohort_ops_ >= budget_end) break;
        auto& db = L.bins_of[donor];
        auto& tb = L.bins_of[to];
        db.erase(std::find(db.begin(), db.end(), ch.give));
        tb.push_back(ch.give);
        if (ch.take >= 0) {
          tb.erase(std::find(tb.begin(), tb.end(), ch.take));
          db.push_back(ch.take);
        }
        ++work_.trials;
        const double threshold = before * (1 - 1e-9);
        double after;
        if (comp[to] == comp[donor]) {
          after = orderCohort(L, members[comp[donor]], threshold, {donor, to});
        } else {
          after = orderCohort(L, members[comp[donor]], threshold, {donor});
          if (after < threshold) after = std::max(after, orderCohort(L, members[comp[to]], threshold, {to}));
        }
        if (after < threshold) {
          ++work_.moves;
          improved = true;
          break;
        }
        db = db0;
        tb = tb0;
        for (size_t i = 0; i < pipes.size(); ++i) {
          L.lists[pipes[i]] = saved_lists[i];
          L.finish[pipes[i]] = saved_finish[i];
        }
      }
    }
    if (!improved) return;
  }
}

}  // namespace ppb
}  // namespace detail
}  // namespace planner
}  // namespace bytescale
