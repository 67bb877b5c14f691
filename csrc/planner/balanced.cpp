// The sync-aware balanced strategy.
//
// It builds the step on a timeline of when each rank becomes free, in the replay's model (a ring
// starts when all its members are free):
//   1. Rings, longest sequence first. For each ring the planner looks at the times ranks become
//      free (buckets of ranks free at the same instant, earliest first) and, for each of the first
//      few candidate start times S, the fewest ranks d (any integer, >= the memory minimum, <= the
//      size with the best time) whose ring still ends within the horizon H. Members are the d ranks
//      free latest but no later than S, so they arrive together: a member free before S waits, and
//      that wait is the candidate's waste. Among candidates ending within H the one wasting least
//      wins (then the earliest); if none fits, the one ending first.
//   2. Local sequences, longest first: best fit into the waits rings left (free capacity), else
//      onto the rank whose tail finishes first (speed- and memory-aware).
// The horizon H is the lower bound times a few factors; every factor gives a complete plan, and the
// one with the shortest step wins. The timeline IS the replay of the emitted order, so the step
// time the planner optimises is the one the runtime gets (under the cost model).
#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>

#include "planner/builder.h"
#include "planner/listsched.h"
#include "planner/peer_budget.h"

namespace bytescale {
namespace planner {
namespace detail {

namespace {

struct RingCand {
  int64_t seq;
  double s;  // tokens
  RingShape shape;
};

struct Gap {
  int rank;
  double room;    // free work (time x speed) before the ring
  int placement;  // the ring it precedes on `rank`
};

// One complete plan for one horizon, in flat arrays.
struct Pass {
  std::vector<int64_t> ring_seq;
  std::vector<double> ring_start, ring_height;
  std::vector<int64_t> ring_off{0};  // members: members[ring_off[k] .. ring_off[k+1])
  std::vector<int> members;
  std::vector<Gap> gaps;
  std::vector<int64_t> locals;  // local sequences, longest first
  std::vector<int64_t> where;   // per local: gap index, or -(rank + 1) for the rank's tail
  double step = 0;
};

constexpr int kCandidates = 6;  // candidate start times examined per ring
// ... under a binding peer budget (IntervalTimeline::choose): 6 cost 3-5% of the step at 1,024
// ranks and 2K-4K capacity on the github batch, 24 up to 3.8%, 64 at most 0.2%
// (benchmarks/RESULTS.md, "Peer budget").
constexpr int kIntervalCandidates = 64;

class Planner {
 public:
  Planner(const Context& ctx, const BoundParts& bound)
      : ctx_(ctx), cm_(ctx.opt.cost), bound_(bound), t1_(ctx.len.size()), shape_(ctx.len.size()),
        has_shape_(ctx.len.size(), 0) {
    for (size_t i = 0; i < ctx.len.size(); ++i) t1_[i] = cm_.seqTime(static_cast<double>(ctx.len[i]));
  }

  Plan run() {
    const double lb = bound_.value();
    static const double kFactors[] = {1.0, 1.03, 1.08, 1.15, 1.3};
    constexpr double kMet = 2e-3;  // a plan "meets" its horizon H when step <= H (1 + kMet)
    Pass best, cur;
    bool have = false;
    auto consider = [&](double H) {
      pass(H, cur);
      const double step = cur.step;
      if (!have || step < best.step * (1 - 1e-12)) {
        std::swap(best, cur);
        have = true;
      }
      return step;
    };
    // Horizons from the bound up, until a plan meets its horizon (a longer one only loosens it).
    // Two horizons giving the same plan say nothing about a longer one: ring sizes are a step
    // function of the horizon (the fewest ranks whose ring ends within it), so every factor runs.
    double failed = 0;  // the largest horizon factor whose plan missed it
    bool met = false;
    for (double f : kFactors) {
      const double step = consider(lb * f);
      if (step <= lb * f * (1 + kMet)) {
        met = true;
        break;
      }
      failed = f;
    }
    // Then bisect between the last missed horizon and the best step (a few passes).
    for (int it = 0; met && failed > 0 && it < 3 && best.step > lb * (failed + kMet); ++it) {
      const double f = 0.5 * (failed + best.step / lb);
      if (consider(lb * f) > lb * f * (1 + kMet)) failed = f;
    }
    return build(best);
  }

 private:
  using Timeline = std::map<double, std::vector<int>>;  // free time -> ranks free then
  struct Visit {
    Timeline::iterator it;
    double t;
    int64_t count;
  };

  const Context& ctx_;
  const CostModel& cm_;
  const BoundParts& bound_;
  std::vector<double> t1_;  // seqTime per sequence
  std::vector<RingShape> shape_;
  std::vector<char> has_shape_;
  std::vector<Visit> visited_;
  std::vector<double> prefix_min_;
  std::vector<double> free_;  // placeIntervals: the free times of a ring's members

  const RingShape& shapeOf(int64_t seq, int dmin) {
    if (!has_shape_[seq]) {
      shape_[seq] = ringShape(cm_, static_cast<double>(ctx_.len[seq]), dmin, ctx_.W);
      has_shape_[seq] = 1;
    }
    return shape_[seq];
  }

  // Which sequences are rings at horizon H: those above every capacity, and those whose
  // single-rank time exceeds H when a ring would shorten them. Longest first.
  void split(double H, std::vector<RingCand>& rings, std::vector<int64_t>& locals) {
    rings.clear();
    locals.clear();
    for (int64_t i : ctx_.order) {
      const int64_t s = ctx_.len[i];
      const bool must = s > ctx_.cap_max;
      if (!must && (ctx_.W == 1 || t1_[i] / ctx_.speed_max <= H)) {
        locals.push_back(i);
        continue;
      }
      const RingShape& sh = shapeOf(i, must ? ctx_.memMin(s).ranks : 2);
      if (!must && cm_.shardedTime(static_cast<double>(s), sh.best) >= t1_[i]) {
        locals.push_back(i);
        continue;
      }
      rings.push_back({i, static_cast<double>(s), sh});
    }
  }

  // Places one ring on the timeline: chooses its start and size (see the file comment).
  void placeRing(const RingCand& rc, double H, Timeline& tl, Pass& out) {
    const RingShape& sh = rc.shape;
    const double v = ctx_.speed_min;  // every rank's speed when the world is uniform
    std::vector<Visit>& visited = visited_;
    visited.clear();
    int64_t cum = 0;
    int seen = 0;
    bool have = false, best_fits = false;
    double best_waste = 0, best_finish = 0, best_t = 0;
    int best_d = 0;
    size_t best_j = 0;
    for (auto it = tl.begin(); it != tl.end(); ++it) {
      const double t = it->first;
      cum += static_cast<int64_t>(it->second.size());
      visited.push_back({it, t, static_cast<int64_t>(it->second.size())});
      if (cum < sh.lo) continue;
      if (have && (seen >= kCandidates || (best_fits && t >= H))) break;
      ++seen;
      const int avail = static_cast<int>(std::min<int64_t>(cum, sh.best));
      int d;
      bool fits;
      double finish;
      if (ctx_.uniform) {
        d = minRanksWithin(cm_, rc.s, sh, (H - t) * v);
        fits = d > 0 && d <= avail;
        if (!fits) d = avail;
        finish = t + cm_.shardedTime(rc.s, d) / v;
      } else {
        sizeMixed(rc, t, avail, H, d, fits, finish);
      }
      // waste: members are the d ranks free latest, no later than t; earlier ones wait
      double waste = 0;
      int64_t need = d;
      for (size_t k = visited.size(); k-- > 0 && need > 0;) {
        const int64_t take = std::min(need, visited[k].count);
        waste += take * (t - visited[k].t);
        need -= take;
      }
      bool better;
      if (!have) better = true;
      else if (fits != best_fits) better = fits;
      else if (fits) better = waste < best_waste * (1 - 1e-12);
      else better = finish < best_finish * (1 - 1e-12);
      if (better) {
        have = true;
        best_fits = fits;
        best_waste = waste;
        best_finish = finish;
        best_t = t;
        best_d = d;
        best_j = visited.size() - 1;
      }
      if (best_fits && best_waste == 0) break;
    }
    if (!have) throw std::logic_error("planner: no start time for a ring (world too small?)");
    // Take the members, latest first, from bucket best_j backwards.
    const int pidx = static_cast<int>(out.ring_seq.size());
    const size_t m0 = out.members.size();
    int64_t need = best_d;
    double ms = 1e300;
    for (size_t k = best_j + 1; k-- > 0 && need > 0;) {
      std::vector<int>& b = visited[k].it->second;
      while (need > 0 && !b.empty()) {
        const int r = b.back();
        b.pop_back();
        out.members.push_back(r);
        ms = std::min(ms, ctx_.speed[r]);
        if (visited[k].t < best_t)
          out.gaps.push_back({r, (best_t - visited[k].t) * ctx_.speed[r], pidx});
        --need;
      }
      if (b.empty()) tl.erase(visited[k].it);
    }
    const double height = cm_.shardedTime(rc.s, best_d) / ms;
    out.ring_seq.push_back(rc.seq);
    out.ring_start.push_back(best_t);
    out.ring_height.push_back(height);
    out.ring_off.push_back(static_cast<int64_t>(out.members.size()));
    std::vector<int>& dst = tl[best_t + height];
    dst.insert(dst.end(), out.members.begin() + m0, out.members.end());
    if (!ctx_.uniform) sortBySpeed(dst);
  }

  // Under a binding peer budget (peer_budget.h): each ring on an interval of ranks free by its
  // start (IntervalTimeline::choose, the same rule as placeRing's), then `tl` as placeRing leaves
  // it. Mixed speeds: sized at the slowest rank's pace, timed at the members' slowest.
  void placeIntervals(const std::vector<RingCand>& rings, double H, Timeline& tl, Pass& out) {
    IntervalTimeline it(ctx_.W);
    const double v = ctx_.speed_min;
    for (const RingCand& rc : rings) {
      const RingShape& sh = rc.shape;
      // minRanksWithin's first two tests (lo ranks within the budget; even the best size not),
      // their times taken once per ring, and the time of the last non-fitting size: most
      // candidates end there (the same comparisons of the same values, so the same sizes).
      const double t_lo = cm_.shardedTime(rc.s, sh.lo), t_best = cm_.shardedTime(rc.s, sh.best);
      int memo_d = -1;
      double memo_t = 0;
      auto sizer = [&](double t, int avail) {
        const double budget = (H - t) * v;
        const int d = t_lo <= budget ? sh.lo : t_best > budget ? -1 : minRanksWithin(cm_, rc.s, sh, budget);
        const bool fits = d > 0 && d <= avail;
        if (fits) return IntervalTimeline::Size{d, true, 0.0};  // a fitting end is not read
        if (avail != memo_d) {
          memo_d = avail;
          memo_t = cm_.shardedTime(rc.s, avail);
        }
        return IntervalTimeline::Size{avail, false, t + memo_t / v};
      };
      const IntervalTimeline::Choice c = it.choose(sh.lo, sh.best, kIntervalCandidates, H, sizer);
      if (c.start < 0) throw std::logic_error("planner: no interval for a ring (world too small?)");
      const int pidx = static_cast<int>(out.ring_seq.size());
      double ms = 1e300;
      it.freeTimes(c.start, c.d, free_);
      for (int r = c.start; r < c.start + c.d; ++r) {
        out.members.push_back(r);
        ms = std::min(ms, ctx_.speed[r]);
        const double f = free_[static_cast<size_t>(r - c.start)];
        if (f < c.t) out.gaps.push_back({r, (c.t - f) * ctx_.speed[r], pidx});
      }
      const double height = cm_.shardedTime(rc.s, c.d) / ms;
      out.ring_seq.push_back(rc.seq);
      out.ring_start.push_back(c.t);
      out.ring_height.push_back(height);
      out.ring_off.push_back(static_cast<int64_t>(out.members.size()));
      it.occupy(c.start, c.d, c.t + height);
    }
    tl.clear();
    it.eachRun([&](int a, int e, double t) {  // one map look-up per run, ranks in order
      std::vector<int>& b = tl[t];
      for (int r = a; r < e; ++r) b.push_back(r);
    });
  }

  // Ranks of a bucket in the order they are taken (from the back): fastest first, then lowest rank.
  void sortBySpeed(std::vector<int>& b) const {
    std::sort(b.begin(), b.end(), [&](int a, int c) {
      return ctx_.speed[a] != ctx_.speed[c] ? ctx_.speed[a] < ctx_.speed[c] : a > c;
    });
  }

  // Mixed speeds: a ring runs at its slowest member's pace. Members are taken latest-free first
  // (fastest first within an instant); the size is the fewest ranks that end within H at the
  // members' actual pace, else the size that ends first.
  void sizeMixed(const RingCand& rc, double t, int avail, double H, int& d, bool& fits,
                 double& finish) {
    std::vector<double>& pm = prefix_min_;
    pm.assign(1, 1e300);
    for (size_t k = visited_.size(); k-- > 0 && static_cast<int>(pm.size()) <= avail;) {
      const std::vector<int>& b = visited_[k].it->second;
      for (size_t q = b.size(); q-- > 0 && static_cast<int>(pm.size()) <= avail;)
        pm.push_back(std::min(pm.back(), ctx_.speed[b[q]]));
    }
    fits = false;
    int arg = -1;
    double best = 0;
    for (int x = rc.shape.lo; x <= avail; ++x) {
      const double f = t + cm_.shardedTime(rc.s, x) / pm[x];
      if (f <= H) {
        d = x;
        finish = f;
        fits = true;
        return;
      }
      if (arg < 0 || f < best) {
        arg = x;
        best = f;
      }
    }
    d = arg;
    finish = best;
  }

  // One complete plan for horizon H.
  void pass(double H, Pass& out) {
    const int W = ctx_.W;
    out.ring_seq.clear();
    out.ring_start.clear();
    out.ring_height.clear();
    out.ring_off.assign(1, 0);
    out.members.clear();
    out.gaps.clear();
    std::vector<RingCand> rings;
    split(H, rings, out.locals);
    // The timeline starts with every rank free at 0, the fastest popping first.
    Timeline tl;
    {
      std::vector<int> all(W);
      for (int r = 0; r < W; ++r) all[r] = W - 1 - r;
      if (!ctx_.uniform)
        std::stable_sort(all.begin(), all.end(),
                         [&](int a, int b) { return ctx_.speed[a] < ctx_.speed[b]; });
      tl.emplace(0.0, std::move(all));
    }
    if (ctx_.bounded) placeIntervals(rings, H, tl, out);
    else for (const RingCand& rc : rings) placeRing(rc, H, tl, out);
    // Locals: best fit into the waits (free work), else the tail that finishes first. Tails are
    // heaps of (free time, rank), one per (speed, capacity) class.
    std::multimap<double, int> gap_room;
    for (size_t g = 0; g < out.gaps.size(); ++g) gap_room.emplace(out.gaps[g].room, static_cast<int>(g));
    std::map<std::pair<double, int64_t>, std::vector<std::pair<double, int>>> classes;
    for (auto& [t, ranks] : tl)
      for (int r : ranks) classes[{ctx_.speed[r], ctx_.cap[r]}].emplace_back(t, r);
    const std::greater<std::pair<double, int>> later;
    for (auto& [key, h] : classes) std::make_heap(h.begin(), h.end(), later);
    out.where.resize(out.locals.size());
    for (size_t li = 0; li < out.locals.size(); ++li) {
      const int64_t i = out.locals[li];
      const int64_t s = ctx_.len[i];
      const double work = t1_[i];
      int tries = 0;
      auto it = gap_room.lower_bound(work);
      for (; it != gap_room.end() && tries < 16; ++it, ++tries)
        if (ctx_.cap[out.gaps[it->second].rank] >= s) break;
      if (it != gap_room.end() && tries < 16) {
        const int g = it->second;
        const double left = it->first - work;
        gap_room.erase(it);
        if (left > 0) gap_room.emplace(left, g);
        out.where[li] = g;
        continue;
      }
      std::vector<std::pair<double, int>>* best = nullptr;
      double best_finish = 0;
      int best_rank = 0;
      for (auto& [key, h] : classes) {
        if (key.second < s || h.empty()) continue;
        const double fin = h.front().first + work / key.first;
        if (!best || fin < best_finish || (fin == best_finish && h.front().second < best_rank)) {
          best = &h;
          best_finish = fin;
          best_rank = h.front().second;
        }
      }
      if (!best)
        throw std::invalid_argument("planner: sequence " + std::to_string(i) + " of " +
                                    std::to_string(s) + " tokens fits no rank");
      std::pop_heap(best->begin(), best->end(), later);
      best->back() = {best_finish, best_rank};
      std::push_heap(best->begin(), best->end(), later);
      out.where[li] = -static_cast<int64_t>(best_rank) - 1;
    }
    double step = 0;
    for (auto& [key, h] : classes)
      for (auto& e : h) step = std::max(step, e.first);
    out.step = step;
  }

  // The plan of a pass: rings by (start, placement) get their global ids; on every member the
  // locals of the wait before a ring come right before it; tails last.
  Plan build(const Pass& p) {
    Builder b(ctx_);
    const size_t R = p.ring_seq.size(), G = p.gaps.size();
    // locals grouped per gap and per tail (counting sort keeps the longest-first order)
    const int W = ctx_.W;
    std::vector<int64_t> off(G + W + 1, 0), grouped(p.locals.size());
    auto key = [&](int64_t w) { return w >= 0 ? static_cast<size_t>(w) : G + static_cast<size_t>(-w - 1); };
    for (int64_t w : p.where) ++off[key(w) + 1];
    for (size_t k = 0; k + 1 < off.size(); ++k) off[k + 1] += off[k];
    {
      std::vector<int64_t> pos(off.begin(), off.end() - 1);
      for (size_t li = 0; li < p.locals.size(); ++li) grouped[pos[key(p.where[li])]++] = p.locals[li];
    }
    std::vector<int> idx(R);
    for (size_t k = 0; k < R; ++k) idx[k] = static_cast<int>(k);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int a, int c) { return p.ring_start[a] < p.ring_start[c]; });
    // gaps per ring (in the order they were recorded)
    std::vector<int64_t> goff(R + 1, 0), gl(G);
    for (const Gap& g : p.gaps) ++goff[g.placement + 1];
    for (size_t k = 0; k < R; ++k) goff[k + 1] += goff[k];
    {
      std::vector<int64_t> pos(goff.begin(), goff.end() - 1);
      for (size_t g = 0; g < G; ++g) gl[pos[p.gaps[g].placement]++] = static_cast<int64_t>(g);
    }
    std::vector<int> members;
    for (int k : idx) {
      for (int64_t j = goff[k]; j < goff[k + 1]; ++j) {
        const int64_t g = gl[j];
        b.packLocal(p.gaps[g].rank, grouped.data() + off[g], static_cast<size_t>(off[g + 1] - off[g]));
      }
      const int64_t s = ctx_.len[p.ring_seq[k]];
      members.assign(p.members.begin() + p.ring_off[k], p.members.begin() + p.ring_off[k + 1]);
      const int d = static_cast<int>(members.size());
      const double ratio = ctx_.opt.offload ? ratioForRanks(cm_, s, ctx_.cap_min, d) : 0.0;
      b.appendRing(p.ring_seq[k], members, ratio, p.ring_height[k]);
    }
    for (int r = 0; r < W; ++r)
      b.packLocal(r, grouped.data() + off[G + r], static_cast<size_t>(off[G + r + 1] - off[G + r]));
    return b.finish(bound_);
  }
};

}  // namespace

Plan planBalanced(const Context& ctx, const BoundParts& bound) { return Planner(ctx, bound).run(); }

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
