// Strategies for pipelines of HDP units (pipeline.h): PP-Balance and Megatron's lockstep slots.
//
// Under 1F1B a pipeline whose micro-batches cost c_1 .. c_n per stage takes about
// sum(c) + (P - 1) max(c): the largest micro-batch's forward and backward cross every stage on the
// critical path (the bubble). A DP bubble is magnified the same way. PP-Balance (the paper's
// Alg. 2 / Fig. 12) therefore keeps every pipeline to one length level and gives the pipelines of
// cheaper micro-batches more of them, so that all pipelines end together:
//   1. rings: sequences above the capacity (at least their memory minimum of units), and sequences
//      whose own chain P x T(s) would exceed the horizon, on the fewest units whose chain fits it;
//      each on the d pipelines that finish earliest with it (the estimate load + c + (P-1) cmax
//      keeps rings together: a pipeline that already carries a larger ring pays no new bubble).
//      A ring sits at the same slot on all its members (its members' rings are numbered from the
//      start of a common "ring region"; a member with fewer rings before it gets a hole there,
//      filled with one of its own largest local micro-batches, else left empty);
//   2. local sequences packed best-fit decreasing into capacity-sized micro-batches, sorted by
//      cost (their length level), then cut into contiguous runs, one per pipeline, pipelines
//      carrying rings first (their bubble is paid already): the smallest target tau (bisection)
//      at which every pipeline's estimate sum(c) + (P-1) max(c) stays within tau;
//   3. order: each pipeline (or each cohort of pipelines joined by rings, together) takes the
//      best of a few orders by the exact pipeline replay: rings first then locals by decreasing
//      cost; the cheapest locals first (ascending), the rings, then the rest decreasing; for
//      pipelines without rings also ascending and the organ-pipe order (cheap ends, costly middle);
//   4. balance: while it shortens the later of the two, a local micro-batch moves from the
//      pipeline that ends last to one that ends first (re-ordered, replayed), within a work bound
//      (kBalanceReplays below: bounded, deterministic work; a trial order whose moved-to or
//      moved-from pipeline alone, its rings as if local, already ends too late is not replayed:
//      waiting for ring partners only delays).
// The horizon is the pipelined lower bound times a few factors; each factor, each micro-batch size
// (capacity-sized bins, and bins of capacity / 2, / 4, / 8: a smaller bubble, (P-1) x the costliest
// micro-batch, against more per-micro-batch overhead), runs or greedy assignment, and ring widths
// (the fewest units within the horizon, or at least as many as keep a ring no costlier than a bin,
// so no ring magnifies its pipelines' bubble) gives a complete plan; the shortest replayed step
// wins; a layout equal to an earlier one (another horizon often changes no ring and no bin) is not
// ordered and balanced again. Safety nets: lockstep slots here, DP-Balance per pipeline in
// makePlan (strategies.cpp), each kept (and named) when it replays shorter.
//
// pp-lockstep (Megatron-LM's dynamic CP with PP, its development branch): every pipeline runs the
// same slots. Rings (memory minimum of units, any integer, as naive) and capacity-sized local
// micro-batches, costliest first, fill slot after slot: an item takes the first slot with enough
// free pipelines, on the free pipelines with the least load. No level grouping, no reordering.
//
// Both plan uniform pipelines (speed and memory multipliers are refused: a pipeline's stages are
// not one device).
#include <algorithm>
#include <cstdio>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/zigzag.h"
#include "planner/builder.h"
#include "planner/pipeline.h"

namespace bytescale {
namespace planner {
namespace detail {

namespace {

thread_local PPBalanceWork g_work;  // the calling thread's current / last planPPBalance

// Work bounds of the balance step (4.), counted in operations replayed, never in time, so every
// rank plans the same batch to the same plan. A layout's balance stops once its replays of cohorts
// of several pipelines (rings join them; each trial replays the whole cohort, with 32 pipelines
// often all of them) have cost kBalanceReplays replays of the whole layout (its micro-batches x
// stages), or kBalanceFloorOps operations where that is more (checked before every trial);
// ring-free pipelines replay alone, cheaply, and stay bounded by the move count. Where the replay
// budget exceeds the floor (a large layout: above ~3K micro-batches x stages, e.g. 400
// micro-batches on 8 stages), a layout whose step before balancing is more than kBalanceMargin
// behind the best plan so far is not balanced. Smaller instances (the tests' and examples' sizes)
// are balanced as before the bounds: on the GoogleTests' and bench_pp.py's mixed batches (up to
// 120 sequences) every plan is unchanged; balancing there can gain more than 3% per layout, so
// the margin would cost them. On the benchmark's batches (700-1,100 sequences, 32 pipelines) the
// bounds leave every plan unchanged (benchmarks/RESULTS.md).
constexpr int64_t kBalanceReplays = 16;
constexpr int64_t kBalanceFloorOps = 50000;
constexpr double kBalanceMargin = 0.03;

struct RingItem {
  int64_t seq = 0;
  int d = 1;
  double cost = 0, ratio = 0;
  std::vector<int> members;  // ascending
  int64_t slot = 0;          // slot within the members' ring region
};

struct Bin {
  int64_t off = 0, end = 0;  // sequences seqs[off .. end), longest first
  int64_t tokens = 0;
  double cost = 0;
};

// An entry of a pipeline's list: a ring (index into rings) or a local bin, at a slot.
struct Entry {
  int32_t ring = -1, bin = -1;
  int64_t slot = 0;
};

// A complete assignment: rings, bins, and per pipeline its bins and ordered entries.
struct Layout {
  std::vector<RingItem> rings;
  std::vector<Bin> bins;
  std::vector<int64_t> seqs;
  std::vector<std::vector<int32_t>> ring_of;  // per pipeline: its rings (indices), in ring-slot order
  std::vector<std::vector<int32_t>> bins_of;  // per pipeline: its bins
  std::vector<std::vector<Entry>> lists;      // per pipeline, in slot order
  std::vector<double> finish;                 // per pipeline (replayed)
  double step = 0;
  bool lockstep = false;                      // built by lockstepLayout
};

void requireUniform(const Context& ctx) {
  if (!ctx.uniform)
    throw std::invalid_argument("planner: strategy '" + strategyName(ctx.opt.strategy) +
                                "' plans uniform pipelines; per-rank speed / memory multipliers are not "
                                "supported with pipelines (a pipeline's stages are several devices)");
}

// Best-fit decreasing of `locals` (longest first) into bins of `bin_cap` tokens (0: the capacity; a
// sequence longer than bin_cap gets a bin of its own).
void packBins(const Context& ctx, const std::vector<int64_t>& locals, Layout& L, int64_t bin_cap = 0) {
  const int64_t cap = bin_cap > 0 ? std::min(bin_cap, ctx.cap_min) : ctx.cap_min;
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> fill;
  std::multimap<int64_t, size_t> room;
  for (int64_t i : locals) {
    const int64_t s = ctx.len[i];
    auto it = room.lower_bound(s);
    size_t k;
    if (it == room.end()) {
      k = bins.size();
      bins.emplace_back();
      fill.push_back(0);
    } else {
      k = it->second;
      room.erase(it);
    }
    bins[k].push_back(i);
    fill[k] += s;
    if (cap - fill[k] > 0) room.emplace(cap - fill[k], k);
  }
  L.bins.clear();
  L.seqs.clear();
  for (size_t k = 0; k < bins.size(); ++k) {
    Bin b;
    b.off = static_cast<int64_t>(L.seqs.size());
    for (int64_t i : bins[k]) {
      L.seqs.push_back(i);
      b.cost += ctx.opt.cost.seqTime(static_cast<double>(ctx.len[i]));
    }
    b.end = static_cast<int64_t>(L.seqs.size());
    b.tokens = fill[k];
    L.bins.push_back(b);
  }
  // costliest first (ties: first opened)
  std::vector<size_t> idx(L.bins.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return L.bins[a].cost > L.bins[b].cost; });
  std::vector<Bin> sorted;
  sorted.reserve(idx.size());
  for (size_t k : idx) sorted.push_back(L.bins[k]);
  L.bins.swap(sorted);
}

// Builds the Plan of a layout: items emitted slot by slot (ring ids in slot order), then the
// pipeline replay.
Plan buildPlan(const Context& ctx, const BoundParts& flat_bound, const Layout& L) {
  const int H = ctx.W;
  struct Ev {
    int64_t slot;
    int h;
    Entry e;
  };
  std::vector<Ev> evs;
  for (int h = 0; h < H; ++h)
    for (const Entry& e : L.lists[h]) evs.push_back({e.slot, h, e});
  std::stable_sort(evs.begin(), evs.end(), [](const Ev& a, const Ev& b) {
    return a.slot != b.slot ? a.slot < b.slot : a.h < b.h;
  });
  Builder b(ctx);
  std::vector<char> emitted(L.rings.size(), 0);
  std::vector<std::vector<int64_t>> slots_of(H);
  for (const Ev& ev : evs) {
    if (ev.e.ring >= 0) {
      const RingItem& r = L.rings[ev.e.ring];
      if (!emitted[ev.e.ring]) {
        emitted[ev.e.ring] = 1;
        b.appendRing(r.seq, r.members, r.ratio, r.cost);
        for (int m : r.members) slots_of[m].push_back(ev.slot);
      }
    } else {
      const Bin& bn = L.bins[ev.e.bin];
      b.addLocal(ev.h, L.seqs.data() + bn.off, static_cast<size_t>(bn.end - bn.off));
      slots_of[ev.h].push_back(ev.slot);
    }
  }
  Plan p = b.finish(flat_bound);
  std::vector<int64_t> slots(p.numMicroBatches());
  for (int h = 0; h < H; ++h) {
    if (static_cast<int64_t>(slots_of[h].size()) != p.rank_mb[h + 1] - p.rank_mb[h])
      throw std::logic_error("pp planner: pipeline " + std::to_string(h) + " lost track of its slots");
    for (size_t i = 0; i < slots_of[h].size(); ++i) slots[p.rank_mb[h] + static_cast<int64_t>(i)] = slots_of[h][i];
  }
  finishPipeline(p, ctx, flat_bound, std::move(slots));
  if (L.lockstep) p.strategy = strategyName(Strategy::kPPLockstep);
  return p;
}

// Megatron's lockstep slots (file comment). no_offload: rings at the fewest units that hold them
// without offloading even when the options allow it (false when one needs more units than exist).
bool lockstepLayout(const Context& ctx, Layout& L, bool no_offload = false) {
  L = Layout();
  L.lockstep = true;
  const int H = ctx.W;
  const CostModel& cm = ctx.opt.cost;
  std::vector<int64_t> locals;
  for (int64_t i : ctx.order) {
    const int64_t s = ctx.len[i];
    if (s <= ctx.cap_max) {
      locals.push_back(i);
      continue;
    }
    RingItem r;
    r.seq = i;
    r.d = no_offload ? ranksWithoutOffload(cm, s, ctx.cap_min) : ctx.memMin(s).ranks;
    if (r.d > H) return false;
    r.cost = cm.shardedTime(static_cast<double>(s), r.d);
    r.ratio = ctx.opt.offload && !no_offload ? ratioForRanks(cm, s, ctx.cap_min, r.d) : 0.0;
    L.rings.push_back(std::move(r));
  }
  packBins(ctx, locals, L);
  // items, costliest first: rings (by cost) and bins
  struct Item {
    double cost;
    int32_t ring, bin;
  };
  std::vector<Item> items;
  for (size_t k = 0; k < L.rings.size(); ++k) items.push_back({L.rings[k].cost, static_cast<int32_t>(k), -1});
  for (size_t k = 0; k < L.bins.size(); ++k) items.push_back({L.bins[k].cost, -1, static_cast<int32_t>(k)});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<std::vector<char>> busy;  // per slot, per pipeline
  std::vector<int> free_count;
  std::vector<double> load(H, 0.0);
  L.lists.assign(H, {});
  size_t first_open = 0;
  std::vector<int> cand;
  for (const Item& it : items) {
    const int d = it.ring >= 0 ? L.rings[it.ring].d : 1;
    size_t k = first_open;
    while (k < busy.size() && free_count[k] < d) ++k;
    if (k == busy.size()) {
      busy.emplace_back(H, 0);
      free_count.push_back(H);
    }
    cand.clear();
    for (int h = 0; h < H; ++h)
      if (!busy[k][h]) cand.push_back(h);
    std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return load[a] < load[b]; });
    cand.resize(d);
    std::sort(cand.begin(), cand.end());
    for (int h : cand) {
      busy[k][h] = 1;
      load[h] += it.cost;
      L.lists[h].push_back({it.ring, it.bin, static_cast<int64_t>(k)});
    }
    free_count[k] -= d;
    if (it.ring >= 0) L.rings[it.ring].members = cand;
    while (first_open < busy.size() && free_count[first_open] == 0) ++first_open;
  }
  for (auto& l : L.lists)
    std::stable_sort(l.begin(), l.end(), [](const Entry& a, const Entry& b) { return a.slot < b.slot; });
  return true;
}


class PPBalance {
 public:
  PPBalance(const Context& ctx, const BoundParts& flat)
      : ctx_(ctx), cm_(ctx.opt.cost), po_(ctx.opt.pipeline), flat_(flat), P_(po_.stages), H_(ctx.W) {}

  Plan run() {
    const double lb = pipelineBound(flat_, ctx_).value();
    static const double kFactors[] = {1.0, 1.05, 1.12, 1.25, 1.5, 2.0, 3.0};
    // Micro-batch sizes: capacity-sized bins have the least per-micro-batch overhead, smaller ones
    // the smallest bubble ((P-1) x the costliest micro-batch) and more pieces to balance with.
    std::vector<int64_t> caps{ctx_.cap_min};
    if (P_ > 1)
      for (int64_t c = ctx_.cap_min / 2; c >= 1 && caps.size() < 4; c /= 2) caps.push_back(c);
    bool any_ring = false;  // a sequence above the capacity, or a horizon short enough to shard one
    for (int64_t i : ctx_.order) any_ring |= ctx_.len[i] > ctx_.cap_max;
    Layout best, cur;
    bool have = false;
    double prev_best = -1;
    int stale = 0;
    for (double f : kFactors) {
      const double T = lb * f;
      for (size_t ci = 0; ci < caps.size(); ++ci) {
        const double before_cap = have ? best.step : -1;
        for (int mode = 0; mode < 4; ++mode) {
          const bool runs = mode % 2 == 0, uniform = mode >= 2;
          if (uniform && !any_ring) continue;
          if (!pass(T, runs, caps[ci], uniform, cur)) continue;
#ifdef PPB_DEBUG
          dump(runs ? "runs" : "lpt", T, cur);
#endif
          if (!have || cur.step < best.step * (1 - 1e-12)) {
            std::swap(best, cur);
            have = true;
            best_step_ = best.step;
          }
        }
        // halving the bins again only helps while the last halving did
        if (ci > 0 && !(best.step < before_cap * (1 - 1e-9))) break;
      }
      if (best.step <= T * (1 + 2e-3)) break;  // a plan meets this horizon: longer ones only loosen it
      // looser horizons stop once two in a row improve nothing
      stale = prev_best >= 0 && !(best.step < prev_best * (1 - 1e-9)) ? stale + 1 : 0;
      prev_best = best.step;
      if (stale >= 2) break;
    }
    // Safety net: Megatron's lockstep slots are a candidate too (kept when their replayed step is
    // shorter), so pp-balance is never worse than pp-lockstep.
    // With offloading allowed, the slots of rings that do not offload are tried as well (Eq. 3's
    // fewest units make a ring's micro-batch, and so its pipelines' bubble, large).
    for (bool no_offload : {false, true}) {
      if (best.step <= lb * (1 + 1e-9) || (no_offload && !ctx_.opt.offload)) continue;
      if (!lockstepLayout(ctx_, cur, no_offload)) continue;
      cur.finish.assign(H_, 0.0);
      std::vector<int> all(H_);
      std::iota(all.begin(), all.end(), 0);
      cur.step = evaluate(cur, all);
      if (cur.step < best.step) std::swap(best, cur);
    }
    return buildPlan(ctx_, flat_, best);
  }

 private:
  const Context& ctx_;
  const CostModel& cm_;
  const PipelineOptions& po_;
  const BoundParts& flat_;
  const int P_, H_;

  double hops(double tokens) const { return P_ > 1 ? 2.0 * (P_ - 1) * po_.p2pTime(tokens) : 0.0; }

#ifdef PPB_DEBUG
  void dump(const char* what, double T, const Layout& L) const {
    fprintf(stderr, "%s T=%.4f step=%.4f\n", what, T, L.step);
    for (int h = 0; h < H_; ++h) {
      fprintf(stderr, "  pipe %d fin %.4f:", h, L.finish[h]);
      for (const Entry& e : L.lists[h]) {
        if (e.ring >= 0) fprintf(stderr, " [%ld]R%d:%.3f", e.slot, e.ring, L.rings[e.ring].cost);
        else fprintf(stderr, " [%ld]%.3f", e.slot, L.bins[e.bin].cost);
      }
      fprintf(stderr, "\n");
    }
  }
#endif
  // ---- 1. rings ----------------------------------------------------------------------------------
  // ring_target > 0: a ring is made at least wide enough that its stage time stays within
  // ring_target (a bin's cost: ring micro-batches no costlier than local ones, so no ring
  // magnifies its pipelines' bubble), up to its best ring size.
  void split(double T, double ring_target, Layout& L, std::vector<int64_t>& locals) const {
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

  // The estimate of a pipeline's step: load + (P-1) x (its costliest chain's stage time).
  double est(double load, double cmax) const { return load + (P_ - 1) * cmax; }
  double chain(double c, double tokens) const {
    return c + (P_ > 1 ? 2.0 * po_.p2pTime(tokens) : 0.0);
  }

  void placeRings(Layout& L, std::vector<double>& load, std::vector<double>& cmax) const {
    std::vector<int64_t> nring(H_, 0);
    std::vector<int> idx(H_);
    std::vector<double> after(H_);
    L.ring_of.assign(H_, {});
    for (size_t k = 0; k < L.rings.size(); ++k) {
      RingItem& r = L.rings[k];
      const double ch = chain(r.cost, static_cast<double>(ctx_.len[r.seq]) / r.d);
      for (int h = 0; h < H_; ++h) after[h] = est(load[h] + r.cost, std::max(cmax[h], ch));
      std::iota(idx.begin(), idx.end(), 0);
      auto cmp = [&](int a, int b) {
        if (after[a] != after[b]) return after[a] < after[b];
        if (nring[a] != nring[b]) return nring[a] > nring[b];  // join an existing cohort
        return a < b;
      };
      std::nth_element(idx.begin(), idx.begin() + (r.d - 1), idx.end(), cmp);
      r.members.assign(idx.begin(), idx.begin() + r.d);
      std::sort(r.members.begin(), r.members.end());
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
  bool fillRuns(const Layout& L, const std::vector<int>& order, const std::vector<double>& load0,
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

  void assignBins(Layout& L, const std::vector<double>& load, const std::vector<double>& cmax,
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
  void orderPipeline(Layout& L, int h, int64_t pre, int tail) const {
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

  // Replays pipelines `pipes` (every member of their rings among them) of layout L; writes
  // L.finish for them and returns their latest finish.
  double evaluate(Layout& L, const std::vector<int>& pipes) {
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
    ++g_work.replays;
    g_work.replayed_ops += v.sched.num_mb * P_;
    if (n > 1) cohort_ops_ += v.sched.num_mb * P_;
    double mx = 0;
    for (int i = 0; i < n; ++i) {
      L.finish[pipes[i]] = w.rep.pipe_finish[i];
      mx = std::max(mx, w.rep.pipe_finish[i]);
    }
    return mx;
  }

  // Buffers of evaluate, reused between replays.
  struct Scratch {
    std::vector<int> local;
    std::vector<int64_t> ring_id, rank_mb, mb_ring, mb_slot, ring_grp;
    std::vector<int32_t> ring_by_id, grp;
    std::vector<double> f, b, p2p;
    PipelineReplay rep;
    ReplayScratch replay;
  };
  Scratch scratch_;

  // The cohort (pipelines joined by rings) of every pipeline: component ids and member lists.
  void cohorts(const Layout& L, std::vector<int>& comp, std::vector<std::vector<int>>& members) const {
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

  // The replay input of the scratch: emptied, then one micro-batch of pipeline h at a time (its
  // stage durations, its transfer, its slot; `ring` the replay's ring id, or -1).
  static void clearOps(Scratch& w) {
    w.rank_mb.assign(1, 0);
    w.mb_ring.clear();
    w.mb_slot.clear();
    w.f.clear();
    w.b.clear();
    w.p2p.clear();
  }

  void pushOp(Scratch& w, const Layout& L, const Entry& e, int h, int64_t ring) const {
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
  double alone(const Layout& L, int h) {
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
    ++g_work.bounds;
    g_work.bound_ops += v.sched.num_mb * P_;
    return w.rep.step_time;
  }

  // Orders one cohort (or one ring-free pipeline) by the best candidate; returns its latest finish.
  // With a threshold (a trial move of the balance step, `changed` its pipelines in this cohort),
  // a candidate order whose changed pipelines alone already end at or after it is not replayed
  // (its step could not be below the threshold); when no candidate is replayed, returns +inf with
  // L's lists and finish times of `pipes` left for the caller to restore.
  double orderCohort(Layout& L, const std::vector<int>& pipes,
                     double threshold = std::numeric_limits<double>::infinity(),
                     const std::vector<int>& changed = {}) {
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
  std::vector<std::vector<Entry>> best_lists_;  // orderCohort's scratch
  std::vector<double> best_finish_;

  // ---- 4. balance ---------------------------------------------------------------------------------
  // Moves a local micro-batch from the pipeline that ends last to one of the pipelines ending first,
  // or swaps one for a cheaper one of theirs, while that shortens the later of the two (cohorts
  // re-ordered and replayed).
  void balance(Layout& L, const std::vector<int>& comp, const std::vector<std::vector<int>>& members) {
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
          ++g_work.trials;
          const double threshold = before * (1 - 1e-9);
          double after;
          if (comp[to] == comp[donor]) {
            after = orderCohort(L, members[comp[donor]], threshold, {donor, to});
          } else {
            after = orderCohort(L, members[comp[donor]], threshold, {donor});
            if (after < threshold) after = std::max(after, orderCohort(L, members[comp[to]], threshold, {to}));
          }
          if (after < threshold) {
            ++g_work.moves;
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

  // One complete layout for horizon T. Returns false (L unfinished) when its assignment (rings,
  // members, bins and their pipelines) equals an earlier pass's: ordering and balancing are a
  // function of the assignment, so that pass's result is this one's and is already a candidate.
  bool pass(double T, bool runs, int64_t bin_cap, bool uniform_rings, Layout& L) {
    ++g_work.passes;
    std::vector<int64_t> locals;
    split(T, uniform_rings ? cm_.seqTime(static_cast<double>(std::min(bin_cap, ctx_.cap_min))) : 0.0, L, locals);
    std::vector<double> load(H_, 0.0), cmax(H_, 0.0);
    placeRings(L, load, cmax);
    packBins(ctx_, locals, L, bin_cap);
    assignBins(L, load, cmax, T, runs);
    if (!firstSeen(L)) {
      ++g_work.passes_skipped;
      return false;
    }
    L.lists.assign(H_, {});
    L.finish.assign(H_, 0.0);
    std::vector<int> comp;
    std::vector<std::vector<int>> members;
    cohorts(L, comp, members);
    for (const auto& c : members) orderCohort(L, c);
    const double pre = *std::max_element(L.finish.begin(), L.finish.end());
    const bool large = kBalanceReplays * layoutOps(L) > kBalanceFloorOps;
    if (!(large && best_step_ > 0 && pre > best_step_ * (1 + kBalanceMargin))) balance(L, comp, members);
    L.step = *std::max_element(L.finish.begin(), L.finish.end());
    return true;
  }

  // Operations of one replay of the whole layout: micro-batches (a ring once per member) x stages.
  int64_t layoutOps(const Layout& L) const {
    int64_t n = 0;
    for (int h = 0; h < H_; ++h) n += static_cast<int64_t>(L.lists[h].size());
    return n * P_;
  }

  // Records the assignment of L; false when an earlier pass had the same one.
  bool firstSeen(const Layout& L) {
    std::vector<int64_t> key;
    for (const RingItem& r : L.rings) {
      key.insert(key.end(), {r.seq, r.d, r.slot});
      key.insert(key.end(), r.members.begin(), r.members.end());
    }
    key.push_back(-1);
    for (int h = 0; h < H_; ++h) {
      for (int32_t k : L.bins_of[h]) {
        const Bin& b = L.bins[k];
        key.insert(key.end(), L.seqs.begin() + b.off, L.seqs.begin() + b.end);
        key.push_back(-2);
      }
      key.push_back(-3);
    }
    return seen_.insert(std::move(key)).second;
  }

  std::set<std::vector<int64_t>> seen_;  // assignments of the passes so far
  double best_step_ = -1;    // of the best layout so far (pass() reads it)
  int64_t cohort_ops_ = 0;   // operations replayed in replays of cohorts of several pipelines
};

}  // namespace

Plan planPPBalance(const Context& ctx, const BoundParts& flat_bound) {
  requireUniform(ctx);
  g_work = PPBalanceWork();
  return PPBalance(ctx, flat_bound).run();
}

PPBalanceWork ppBalanceWork() { return g_work; }

Plan planPPLockstep(const Context& ctx, const BoundParts& flat_bound) {
  requireUniform(ctx);
  Layout L;
  lockstepLayout(ctx, L);
  return buildPlan(ctx, flat_bound, L);
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
