// makePlan: input checks, the shared builder, and the token-balanced strategies (naive, pow2).
// The sync-aware balanced strategy lives in balanced.cpp.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "common/zigzag.h"
#include "planner/builder.h"
#include "planner/feasibility.h"
#include "planner/pipeline.h"
#include "planner/offload_rule.h"
#include "planner/packing.h"
#include "planner/peer_budget.h"
#include "planner/replay.h"

namespace bytescale {
namespace planner {
namespace detail {

namespace {

void validateInput(const std::vector<int64_t>& lengths, const PlanOptions& opt) {
  if (opt.world_size < 1)
    throw std::invalid_argument("planner: world_size must be >= 1, got " +
                                std::to_string(opt.world_size));
  if (opt.capacity < 1)
    throw std::invalid_argument("planner: capacity must be >= 1 token, got " +
                                std::to_string(opt.capacity));
  auto check_vec = [&](const std::vector<double>& v, const char* name) {
    if (v.empty()) return;
    if (static_cast<int>(v.size()) != opt.world_size)
      throw std::invalid_argument(std::string("planner: ") + name + " has " +
                                  std::to_string(v.size()) + " entries for world_size " +
                                  std::to_string(opt.world_size));
    for (size_t r = 0; r < v.size(); ++r)
      if (!(v[r] > 0) || !std::isfinite(v[r])) {
        std::ostringstream os;
        os << "planner: " << name << "[" << r << "] = " << v[r] << " must be positive and finite";
        throw std::invalid_argument(os.str());
      }
  };
  check_vec(opt.speed, "speed");
  check_vec(opt.memory, "memory");
  opt.cost.validate();
  validatePeerBudget(opt.peer_budget);
  if (opt.static_cp < 0)
    throw std::invalid_argument("planner: static_cp must be >= 0 (0: sized for the longest sequence), got " +
                                std::to_string(opt.static_cp));
  if (opt.strategy != Strategy::kStatic && opt.static_cp != 0)
    throw std::invalid_argument("planner: static_cp = " + std::to_string(opt.static_cp) +
                                " applies to strategy 'static' only (strategy is '" +
                                strategyName(opt.strategy) + "')");
  if (opt.strategy == Strategy::kStatic) {
    if (opt.offload)
      throw std::invalid_argument(
          "planner: strategy 'static' (the DP x CP baseline) does not offload activations; "
          "turn offloading off or choose an HDP strategy");
    if (opt.static_cp > opt.world_size)
      throw std::invalid_argument("planner: static_cp = " + std::to_string(opt.static_cp) +
                                  " is larger than world_size " + std::to_string(opt.world_size));
    if (opt.static_cp > 0 && opt.world_size % opt.static_cp != 0)
      throw std::invalid_argument("planner: static_cp = " + std::to_string(opt.static_cp) +
                                  " does not divide world_size " + std::to_string(opt.world_size) +
                                  " (the DP x CP baseline needs world_size = DP x CP)");
  }
  for (size_t i = 0; i < lengths.size(); ++i)
    if (lengths[i] <= 0)
      throw std::invalid_argument("planner: sequence " + std::to_string(i) + " has length " +
                                  std::to_string(lengths[i]) + " (lengths must be positive)");
    else if (lengths[i] > (int64_t{1} << 40))
      throw std::invalid_argument("planner: sequence " + std::to_string(i) + " has length " +
                                  std::to_string(lengths[i]) + " (more than 2^40 tokens)");
}

int nextPow2(int d) {
  int p = 1;
  while (p < d) p <<= 1;
  return p;
}

std::vector<int> popLeast(LoadHeap& heap, int d) {
  std::vector<int> out;
  out.reserve(d);
  for (int k = 0; k < d; ++k) {
    out.push_back(heap.top().second);
    heap.pop();
  }
  return out;
}

}  // namespace

// naive / pow2: balance TOKENS (memory), as the paper's Alg. 1 does; rings first, then locals.
Builder tokenBalanced(const Context& ctx, Strategy strategy, const std::vector<int>* ring_sizes) {
  const PlanOptions& opt = ctx.opt;
  const CostModel& cm = opt.cost;
  const auto& lengths = ctx.len;
  const int W = ctx.W;
  Builder b(ctx);
  LoadHeap heap;
  std::vector<double> tokens(W, 0.0);
  for (int r = 0; r < W; ++r) heap.emplace(0.0, r);
  WindowTree windows(ctx.bounded ? W : 1);
  std::vector<int64_t> shorts;
  for (int64_t i : ctx.order) {
    const int64_t s = lengths[i];
    if (s <= ctx.cap_min) {
      shorts.push_back(i);
      continue;
    }
    int d = ring_sizes ? (*ring_sizes)[i] : ctx.memMin(s).ranks;
    if (strategy == Strategy::kPow2 && !ring_sizes) d = std::min(nextPow2(d), W);
    std::vector<int> members;
    if (ctx.bounded) {  // the window of d ranks holding the fewest tokens (peer_budget.h)
      const int a = windows.best(d);
      for (int k = 0; k < d; ++k) members.push_back(a + k);
      windows.add(a, d, static_cast<double>(s) / d);
    } else {
      members = popLeast(heap, d);
    }
    for (int r : members) {
      tokens[r] += static_cast<double>(s) / d;
      if (!ctx.bounded) heap.emplace(tokens[r], r);
    }
    b.addRing(i, members, opt.offload ? ratioForRanks(cm, s, ctx.cap_min, d) : 0.0);
  }
  if (ctx.bounded) {  // the locals' heap: every rank at its tokens after the rings
    heap = LoadHeap();
    for (int r = 0; r < W; ++r) heap.emplace(tokens[r], r);
  }
  // Best-fit decreasing into capacity-sized bins, bins to the rank with the fewest tokens.
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> fill;
  packBestFit(lengths, shorts.data(), shorts.size(), ctx.cap_min, 0, bins, fill);
  for (size_t k = 0; k < bins.size(); ++k) {
    auto top = heap.top();
    heap.pop();
    const int r = top.second;
    b.addLocal(r, bins[k].data(), bins[k].size());
    tokens[r] += static_cast<double>(fill[k]);
    heap.emplace(tokens[r], r);
  }
  return b;
}

double ratioForRanks(const CostModel& m, int64_t s, int64_t cap, int d) {
  const int l = m.layers;
  const double act_s = m.act(static_cast<double>(s)), act_c = m.act(static_cast<double>(cap));
  if (act_s <= d * act_c * (1 + 1e-12) || l <= 2) return 0.0;
  double r = 1.0 - (d * l * act_c / act_s - 2.0) / (l - 2);
  return std::clamp(r, 0.0, 1.0);
}

Context::Context(const std::vector<int64_t>& lengths, const PlanOptions& o)
    : opt(o), len(lengths), W(o.world_size), cap(o.world_size), speed(o.world_size) {
  speed_sum = 0;
  speed_max = 0;
  speed_min = 1e300;
  for (int r = 0; r < W; ++r) {
    cap[r] = rankCapacity(o, r);
    speed[r] = speedOf(o, r);
    speed_sum += speed[r];
    speed_max = std::max(speed_max, speed[r]);
    speed_min = std::min(speed_min, speed[r]);
  }
  cap_min = *std::min_element(cap.begin(), cap.end());
  cap_max = *std::max_element(cap.begin(), cap.end());
  uniform = cap_min == cap_max && speed_min == speed_max;
  bounded = peerBounded(o);
  order.resize(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  // Every sequence must fit the world (a sequence above the largest capacity is sharded over at
  // least its memory minimum at the smallest one).
  // The rule is the planner's one feasibility rule (feasibility.h), which the data loader applies
  // to a whole corpus before the first step.
  for (int64_t i : order) {
    const int64_t s = lengths[i];
    if (s <= cap_max) break;
    if (!placeable(o, s, cap_min, cap_max)) {
      const int dmin = memMin(s).ranks;
      std::ostringstream os;
      os << "planner: sequence " << i << " of " << s << " tokens needs " << dmin
         << " ranks at capacity " << cap_min << (o.offload ? " (with offloading)" : "")
         << " but the world has " << W << " ranks";
      throw std::invalid_argument(os.str());
    }
  }
}

OffloadChoice Context::memMin(int64_t s) const { return offloadFloor(opt, s, cap_min); }

void Builder::appendRing(const int64_t* seqs, size_t n, std::vector<int> members, double ratio,
                         double cost) {
  if (ctx.bounded) orderBoundedRing(members, strategyName(ctx.opt.strategy));
  else std::sort(members.begin(), members.end());
  const int64_t ring = numRings();
  grp_ranks.insert(grp_ranks.end(), members.begin(), members.end());
  ring_grp.push_back(static_cast<int64_t>(grp_ranks.size()));
  ring_seqs.insert(ring_seqs.end(), seqs, seqs + n);
  ring_off.push_back(static_cast<int64_t>(ring_seqs.size()));
  ring_cost.push_back(cost);
  ring_ratio.push_back(ratio);
  for (size_t pos = 0; pos < members.size(); ++pos) {
    item_rank.push_back(members[pos]);
    item.push_back(ring);
    item_pos.push_back(static_cast<int32_t>(pos));
  }
}

void Builder::addRing(int64_t seq, std::vector<int> members, double ratio) {
  double min_speed = 1e300;
  for (int r : members) min_speed = std::min(min_speed, ctx.speed[r]);
  const double cost =
      ctx.opt.cost.shardedTime(static_cast<double>(ctx.len[seq]), static_cast<int>(members.size())) /
      min_speed;
  appendRing(seq, std::move(members), ratio, cost);
}

void Builder::addLocal(int r, const int64_t* seqs, size_t n) {
  double cost = 0;
  int64_t tokens = 0;
  for (size_t k = 0; k < n; ++k) {
    lmb_seqs.push_back(seqs[k]);
    tokens += ctx.len[seqs[k]];
    cost += ctx.opt.cost.seqTime(static_cast<double>(ctx.len[seqs[k]])) / ctx.speed[r];
  }
  lmb_off.push_back(static_cast<int64_t>(lmb_seqs.size()));
  lmb_tokens.push_back(tokens);
  lmb_cost.push_back(cost);
  item_rank.push_back(r);
  item.push_back(-static_cast<int64_t>(lmb_tokens.size()));
  item_pos.push_back(0);
}

double Builder::ringsFirstStep() const {
  std::vector<double> free(ctx.W, 0.0);
  for (int64_t k = 0; k < numRings(); ++k) {
    double start = 0;
    for (int64_t g = ring_grp[k]; g < ring_grp[k + 1]; ++g) start = std::max(start, free[grp_ranks[g]]);
    for (int64_t g = ring_grp[k]; g < ring_grp[k + 1]; ++g) free[grp_ranks[g]] = start + ring_cost[k];
  }
  for (size_t k = 0; k < item.size(); ++k)
    if (item[k] < 0) free[item_rank[k]] += lmb_cost[-item[k] - 1];
  return *std::max_element(free.begin(), free.end());
}

void Builder::packLocal(int r, const int64_t* seqs, size_t n) {
  if (n == 0) return;
  const auto& len = ctx.len;
  const int64_t cap = ctx.cap[r];
  // Best fit decreasing (packing.h): a scan up to 32 sequences, an ordered map beyond.
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> fill;
  packBestFit(len, seqs, n, cap, 32, bins, fill);
  for (auto& bin : bins) addLocal(r, bin.data(), bin.size());
}

Plan Builder::finish(const BoundParts& bound) {
  const int W = ctx.W;
  Plan p;
  p.world_size = W;
  p.strategy = strategyName(ctx.opt.strategy);
  p.num_sequences = static_cast<int64_t>(ctx.len.size());
  // Stable counting sort of the emission log by rank: each rank's items in emission order.
  const size_t I = item.size();
  p.rank_mb.assign(W + 1, 0);
  for (size_t k = 0; k < I; ++k) ++p.rank_mb[item_rank[k] + 1];
  for (int r = 0; r < W; ++r) p.rank_mb[r + 1] += p.rank_mb[r];
  std::vector<int64_t> slot(p.rank_mb.begin(), p.rank_mb.end() - 1);
  std::vector<size_t> at(I);
  for (size_t k = 0; k < I; ++k) at[slot[item_rank[k]]++] = k;
  p.mb_seg.reserve(I + 1);
  p.mb_seg.push_back(0);
  p.mb_offload.resize(I);
  p.mb_cost.resize(I);
  p.mb_tokens.resize(I);
  p.mb_ring.resize(I);
  p.rank_cost.assign(W, 0.0);
  size_t S = lmb_seqs.size();
  for (int64_t k = 0; k < numRings(); ++k)
    S += static_cast<size_t>((ring_grp[k + 1] - ring_grp[k]) * (ring_off[k + 1] - ring_off[k]));
  p.seg_seq.reserve(S);
  p.seg_ring_size.reserve(S);
  p.seg_ring_pos.reserve(S);
  p.seg_tokens.reserve(S);
  for (int r = 0; r < W; ++r) {
    for (int64_t m = p.rank_mb[r]; m < p.rank_mb[r + 1]; ++m) {
      const size_t k = at[m];
      const int64_t it = item[k];
      if (it >= 0) {
        const int d = static_cast<int>(ring_grp[it + 1] - ring_grp[it]);
        int64_t tok = 0;
        for (int64_t j = ring_off[it]; j < ring_off[it + 1]; ++j) {
          const int64_t seq = ring_seqs[j];
          const int64_t t = zigzag::local_tokens(ctx.len[seq], d, item_pos[k]);
          p.seg_seq.push_back(seq);
          p.seg_ring_size.push_back(d);
          p.seg_ring_pos.push_back(item_pos[k]);
          p.seg_tokens.push_back(t);
          tok += t;
        }
        p.mb_offload[m] = ring_ratio[it];
        p.mb_cost[m] = ring_cost[it];
        p.mb_tokens[m] = tok;
        p.mb_ring[m] = it;
      } else {
        const int64_t l = -it - 1;
        for (int64_t j = lmb_off[l]; j < lmb_off[l + 1]; ++j) {
          p.seg_seq.push_back(lmb_seqs[j]);
          p.seg_ring_size.push_back(1);
          p.seg_ring_pos.push_back(0);
          p.seg_tokens.push_back(ctx.len[lmb_seqs[j]]);
        }
        p.mb_offload[m] = 0.0;
        p.mb_cost[m] = lmb_cost[l];
        p.mb_tokens[m] = lmb_tokens[l];
        p.mb_ring[m] = -1;
      }
      p.mb_seg.push_back(static_cast<int64_t>(p.seg_seq.size()));
      p.rank_cost[r] += p.mb_cost[m];
    }
  }
  p.ring_grp = std::move(ring_grp);
  p.grp_ranks = std::move(grp_ranks);
  for (int64_t m = 0; m < static_cast<int64_t>(p.mb_cost.size()); ++m)
    if (!std::isfinite(p.mb_cost[m]))
      throw std::invalid_argument(
          "plan: the cost model gives micro-batch " + std::to_string(m) + " (" +
          std::to_string(p.mb_tokens[m]) + " tokens) a cost of " + std::to_string(p.mb_cost[m]) +
          " s; its coefficients are too large for these lengths");
  ReplayResult rep = replay(p);
  p.rank_finish = std::move(rep.rank_finish);
  p.makespan = rep.step_time;
  double sum = 0, mx = 0;
  for (double c : p.rank_cost) {
    sum += c;
    mx = std::max(mx, c);
  }
  p.rank_idle.resize(W);
  for (int r = 0; r < W; ++r) p.rank_idle[r] = std::max(0.0, p.makespan - p.rank_cost[r]);
  p.max_busy = mx;
  p.mean_cost = sum / W;
  p.imbalance = p.mean_cost > 0 ? p.makespan / p.mean_cost : 1.0;
  p.bound_work = bound.work;
  p.bound_piece = bound.piece;
  p.bound_waves = bound.waves;
  p.lower_bound = bound.value();
  return p;
}

}  // namespace detail

namespace {
// The strategies without pipelines (pipeline.h adds the stages to their per-rank order).
Plan makeFlat(const std::vector<int64_t>& lengths, const PlanOptions& opt, const detail::Context& ctx,
              const BoundParts& bound) {
  if (opt.strategy == Strategy::kStatic) {
    int64_t longest = 0;
    for (int64_t s : lengths) longest = std::max(longest, s);
    const int cp = opt.static_cp > 0 ? opt.static_cp
                                     : staticCpDegree(longest, ctx.cap_min, opt.world_size);
    return detail::staticDpCp(ctx, cp).finish(bound);
  }
  if (opt.offload && opt.offload_rule == OffloadRule::kStep && !detail::insideStepClock())
    return detail::planStepClock(ctx, bound);
  if (opt.strategy != Strategy::kBalanced)
    return detail::tokenBalanced(ctx, opt.strategy).finish(bound);
  Plan p = detail::planBalanced(ctx, bound);
  // Safety net: the pow2 plan is a candidate too (kept when its replayed step is shorter, and
  // then named "pow2"), so balanced is never worse than pow2. Skipped when balanced already meets
  // the lower bound.
  if (p.makespan > bound.value() * (1 + 1e-9) && ctx.W > 1) {
    detail::Builder q = detail::tokenBalanced(ctx, Strategy::kPow2);
    if (q.ringsFirstStep() < p.makespan * (1 - 1e-12)) {
      Plan alt = q.finish(bound);
      if (alt.makespan < p.makespan) {
        alt.strategy = strategyName(Strategy::kPow2);
        p = std::move(alt);
      }
    }
  }
  // Small instances: a search over list schedules from the better of the two.
  return detail::refineSmall(ctx, bound, std::move(p));
}

}  // namespace

Plan makePlan(const std::vector<int64_t>& lengths, const PlanOptions& opt) {
  detail::validateInput(lengths, opt);
  validatePipelineOptions(opt.pipeline);
  detail::Context ctx(lengths, opt);
  const BoundParts bound = lowerBound(lengths, opt);
  if (opt.strategy == Strategy::kPPBalance) {
    Plan p = detail::planPPBalance(ctx, bound);
    // Safety net: DP-Balance per pipeline (the balanced plan, slotted) is a candidate too, kept
    // (and named "balanced") when its replayed step is shorter; pp-balance itself keeps lockstep
    // slots the same way (named "pp-lockstep").
    // With offloading allowed, DP-Balance without it is tried as well (when every sequence fits).
    for (int k = 0; k < 2; ++k) {
      const bool offload = k == 0 && opt.offload;
      if ((k == 1 && !opt.offload) || p.makespan <= p.lower_bound * (1 + 1e-9) || ctx.W == 1) break;
      PlanOptions flat = opt;
      flat.strategy = Strategy::kBalanced;
      flat.offload = offload;
      Plan q;
      try {
        const detail::Context fctx(lengths, flat);
        const BoundParts fb = lowerBound(lengths, flat);
        q = makeFlat(lengths, flat, fctx, fb);
        detail::finishPipeline(q, fctx, fb);
      } catch (const std::invalid_argument&) {
        continue;  // a sequence needs more ranks than exist without offloading
      }
      if (q.makespan < p.makespan * (1 - 1e-12)) {
        // the bound is the options' (offloading allowed: never above the one without)
        q.bound_work = p.bound_work;
        q.bound_piece = p.bound_piece;
        q.bound_waves = p.bound_waves;
        q.lower_bound = p.lower_bound;
        q.imbalance = q.mean_cost > 0 ? q.makespan / q.mean_cost : 1.0;
        p = std::move(q);
      }
    }
    return p;
  }
  if (opt.strategy == Strategy::kPPLockstep) return detail::planPPLockstep(ctx, bound);
  Plan p = makeFlat(lengths, opt, ctx, bound);
  if (opt.pipeline.stages > 1) detail::finishPipeline(p, ctx, bound);
  return p;
}

}  // namespace planner
}  // namespace bytescale
