// Pipelined plans, plan building: option and depth checks, the pipelined lower bound, slots of a
// finished flat plan and its replayed step, the replay agreement check (pipeline.h). The 1F1B
// order and its replay are pipeline_replay.cpp.
#include "planner/pipeline.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "planner/builder.h"

namespace bytescale {
namespace planner {

namespace {

std::string num(int64_t v) { return std::to_string(v); }

}  // namespace

void checkPipelineDepth(const Plan& p, int stages) {
  if (stages < 1) throw std::invalid_argument("pipeline depth must be >= 1, got " + num(stages));
  if (p.pp != stages)
    throw std::invalid_argument("plan: made for a pipeline depth of " + num(p.pp) + " stages, the runtime has " +
                                num(stages) + " (plan with pp = " + num(stages) + ")");
  if (stages > 1 && !p.pipelined() && p.numMicroBatches() > 0)
    throw std::invalid_argument("plan: pp = " + num(stages) + " but the plan has no slots");
}

int stageLayers(int layers, int stages) {
  if (layers < 1 || stages < 1)
    throw std::invalid_argument("pipeline: need layers >= 1 and stages >= 1, got " + num(layers) + " layers and " +
                                num(stages) + " stages");
  if (layers % stages)
    throw std::invalid_argument("pipeline: " + num(stages) + " stages do not divide the model's " + num(layers) +
                                " layers (every stage holds the same number of layers; choose a pipeline depth "
                                "that divides " + num(layers) + ")");
  return layers / stages;
}

void validatePipelineOptions(const PipelineOptions& po) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("planner: pipeline " + m); };
  if (po.stages < 1) fail("stages (pp) must be >= 1, got " + num(po.stages));
  if (po.stages > 4096) fail("stages (pp) = " + num(po.stages) + " is implausibly large (at most 4096)");
  if (!(po.fwd_share > 0 && po.fwd_share < 1))
    fail("fwd_share must be in (0, 1) (the forward's share of forward + backward), got " +
         std::to_string(po.fwd_share));
  if (!(po.p2p_bytes_per_token >= 0) || !std::isfinite(po.p2p_bytes_per_token))
    fail("p2p_bytes_per_token must be finite and >= 0, got " + std::to_string(po.p2p_bytes_per_token));
  if (!(po.p2p_bw > 0) || !std::isfinite(po.p2p_bw))
    fail("p2p_bw must be finite and > 0, got " + std::to_string(po.p2p_bw));
  if (!(po.p2p_latency >= 0) || !std::isfinite(po.p2p_latency))
    fail("p2p_latency must be finite and >= 0, got " + std::to_string(po.p2p_latency));
}

namespace detail {

BoundParts pipelineBound(const BoundParts& flat, const Context& ctx) {
  const PipelineOptions& po = ctx.opt.pipeline;
  const int P = po.stages;
  BoundParts b = flat;
  if (ctx.len.empty()) return b;
  int64_t shortest = ctx.len[ctx.order.back()];
  const CostModel& cm = ctx.opt.cost;
  const RingShape sh = ringShape(cm, static_cast<double>(shortest), 1, ctx.W);
  const double c_min = cm.shardedTime(static_cast<double>(shortest), sh.best) / ctx.speed_max;
  const double hops = 2.0 * (P - 1) * po.p2p_latency;
  b.work = flat.work + (P - 1) * c_min + hops;
  b.piece = P * flat.piece + hops;
  return b;
}

namespace {

// Slots keeping each pipeline's order: a ring sits at the earliest slot all members reach (after
// their previous micro-batches), locals at the next slot of their pipeline. Ring ids increase
// along every list (makePlan's plans), so visiting rings by id sees each member's earlier rings
// placed first.
std::vector<int64_t> alignSlots(const Plan& p) {
  const int H = p.world_size;
  const int64_t M = p.numMicroBatches(), R = p.numRings();
  std::vector<int64_t> slot(M, -1), ring_mbs(p.grp_ranks.size()), fill(R, 0);
  std::vector<int64_t> pos(H);  // per pipeline: first micro-batch without a slot
  std::vector<int64_t> next_slot(H, 0);
  for (int h = 0; h < H; ++h) pos[h] = p.rank_mb[h];
  for (int h = 0; h < H; ++h)
    for (int64_t m = p.rank_mb[h]; m < p.rank_mb[h + 1]; ++m)
      if (p.mb_ring[m] >= 0) ring_mbs[p.ring_grp[p.mb_ring[m]] + fill[p.mb_ring[m]]++] = m;
  std::vector<int> owner(M);
  for (int h = 0; h < H; ++h)
    for (int64_t m = p.rank_mb[h]; m < p.rank_mb[h + 1]; ++m) owner[m] = h;
  auto advance_locals = [&](int h) {
    while (pos[h] < p.rank_mb[h + 1] && p.mb_ring[pos[h]] < 0) slot[pos[h]++] = next_slot[h]++;
  };
  for (int64_t id = 0; id < R; ++id) {
    int64_t at = 0;
    for (int64_t g = p.ring_grp[id]; g < p.ring_grp[id + 1]; ++g) {
      const int h = owner[ring_mbs[g]];
      advance_locals(h);
      if (pos[h] != ring_mbs[g])
        throw std::invalid_argument("plan: pipeline " + num(h) + " lists ring " + num(id) +
                                    " after a ring of a larger id; cannot align slots");
      at = std::max(at, next_slot[h]);
    }
    for (int64_t g = p.ring_grp[id]; g < p.ring_grp[id + 1]; ++g) {
      const int h = owner[ring_mbs[g]];
      slot[pos[h]++] = at;
      next_slot[h] = at + 1;
    }
  }
  for (int h = 0; h < H; ++h) advance_locals(h);
  return slot;
}

}  // namespace

void finishPipeline(Plan& p, const Context& ctx, const BoundParts& flat_bound, std::vector<int64_t> slots) {
  const PipelineOptions& po = ctx.opt.pipeline;
  const int64_t M = p.numMicroBatches();
  p.pp = po.stages;
  p.pp_fwd_share = po.fwd_share;
  const BoundParts bound = pipelineBound(flat_bound, ctx);
  p.bound_work = bound.work;
  p.bound_piece = bound.piece;
  p.bound_waves = bound.waves;
  p.lower_bound = bound.value();
  if (M == 0) {
    p.mb_slot.clear();
    p.mb_p2p.clear();
    return;
  }
  p.mb_slot = slots.empty() ? alignSlots(p) : std::move(slots);
  p.mb_p2p.resize(M);
  for (int64_t m = 0; m < M; ++m) p.mb_p2p[m] = po.stages > 1 ? po.p2pTime(static_cast<double>(p.mb_tokens[m])) : 0.0;
  const PipelineReplay rep = replayPipeline(p);
  p.rank_finish = rep.pipe_finish;
  p.makespan = rep.step_time;
  const int H = p.world_size;
  for (int h = 0; h < H; ++h) p.rank_idle[h] = std::max(0.0, p.makespan - p.rank_cost[h]);
  p.imbalance = p.mean_cost > 0 ? p.makespan / p.mean_cost : 1.0;
}

void verifyPipeline(const Plan& p, const PlanOptions& opt) {
  auto fail = [](const std::string& m) { throw std::logic_error("plan invariant violated: " + m); };
  if (p.pp != opt.pipeline.stages) fail("pp is not the options' pipeline depth");
  PipelineReplay rep;
  try {
    rep = replayPipeline(p);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  auto close = [](double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b)); };
  if (!close(p.makespan, rep.step_time)) fail("makespan is not the pipeline replay's step time");
  for (int h = 0; h < p.world_size; ++h)
    if (!close(p.rank_finish[h], rep.pipe_finish[h])) fail("rank_finish of pipeline " + num(h));
  for (int64_t m = 0; m < p.numMicroBatches(); ++m) {
    const double want = p.pp > 1 ? opt.pipeline.p2pTime(static_cast<double>(p.mb_tokens[m])) : 0.0;
    if (!close(p.mb_p2p[m], want)) fail("transfer time of micro-batch " + num(m));
  }
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
