// PP-Balance and pp-lockstep layouts (pp_balance.cpp): local sequences packed into bins, Megatron's
// lockstep slots (pp-lockstep, and PP-Balance's safety net), the Plan of a layout.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner/packing.h"
#include "planner/peer_budget.h"
#include "planner/pp_balance.h"

namespace bytescale {
namespace planner {
namespace detail {
namespace ppb {

void requireUniform(const Context& ctx) {
  if (!ctx.uniform)
    throw std::invalid_argument("planner: strategy '" + strategyName(ctx.opt.strategy) +
                                "' plans uniform pipelines; per-rank speed / memory multipliers are not "
                                "supported with pipelines (a pipeline's stages are several devices)");
}

void packBins(const Context& ctx, const std::vector<int64_t>& locals, Layout& L, int64_t bin_cap) {
  const int64_t cap = bin_cap > 0 ? std::min(bin_cap, ctx.cap_min) : ctx.cap_min;
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> fill;
  packBestFit(ctx.len, locals.data(), locals.size(), cap, 0, bins, fill);
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

bool lockstepLayout(const Context& ctx, Layout& L, bool no_offload) {
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
  std::vector<char> open_h;
  for (const Item& it : items) {
    const int d = it.ring >= 0 ? L.rings[it.ring].d : 1;
    size_t k = first_open;
    int win = -1;  // peer budget (peer_budget.h): a ring takes a window of free pipelines
    for (; k < busy.size(); ++k) {
      if (free_count[k] < d) continue;
      if (!ctx.bounded || d == 1) break;
      open_h.assign(H, 0);
      for (int h = 0; h < H; ++h) open_h[h] = !busy[k][h];
      if ((win = bestWindow(load, d, &open_h)) >= 0) break;
    }
    if (k == busy.size()) {
      busy.emplace_back(H, 0);
      free_count.push_back(H);
      if (ctx.bounded && d > 1) win = bestWindow(load, d);
    }
    cand.clear();
    if (win >= 0) {
      for (int h = win; h < win + d; ++h) cand.push_back(h);
    } else {
      for (int h = 0; h < H; ++h)
        if (!busy[k][h]) cand.push_back(h);
      std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return load[a] < load[b]; });
      cand.resize(d);
      std::sort(cand.begin(), cand.end());
    }
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

}  // namespace ppb

Plan planPPLockstep(const Context& ctx, const BoundParts& flat_bound) {
  ppb::requireUniform(ctx);
  ppb::Layout L;
  ppb::lockstepLayout(ctx, L);
  return ppb::buildPlan(ctx, flat_bound, L);
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
