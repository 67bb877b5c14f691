// Offloading under the step's clock and the per-sequence reasons for ring sizes (offload_rule.h).
#include "planner/offload_rule.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <utility>

#include "planner/builder.h"

namespace bytescale {
namespace planner {

OffloadRule parseOffloadRule(const std::string& name) {
  if (name == "step") return OffloadRule::kStep;
  if (name == "paper-eq3") return OffloadRule::kPaperEq3;
  throw std::invalid_argument("planner: unknown offload rule '" + name +
                              "' (expected 'step' or 'paper-eq3')");
}

std::string offloadRuleName(OffloadRule r) {
  return r == OffloadRule::kPaperEq3 ? "paper-eq3" : "step";
}

std::string ringReasonName(RingReason r) {
  switch (r) {
    case RingReason::kLocal: return "local";
    case RingReason::kMemory: return "memory";
    case RingReason::kCopyHiding: return "copy-hiding";
    case RingReason::kStep: return "step";
    case RingReason::kShape: return "shape";
  }
  return "?";
}

OffloadChoice offloadFloor(const PlanOptions& opt, int64_t s, int64_t capacity) {
  if (!opt.offload) return {ranksWithoutOffload(opt.cost, s, capacity), 0.0};
  const OffloadChoice paper = solveOffload(opt.cost, s, capacity, 1.0);
  if (opt.offload_rule != OffloadRule::kStep) return paper;
  const OffloadChoice hidden = solveOffload(opt.cost, s, capacity, kForwardShare);
  // A sequence the world holds only with copies that do not fully hide keeps the paper's floor:
  // memory decides there (without offloading it would not fit at all).
  return hidden.ranks <= opt.world_size ? hidden : paper;
}

namespace {

// The clocks tried: T, 0.9 T, 0.81 T, ... (a plan is rebuilt only when some ring size changes).
constexpr double kClockStep = 0.9;

// Depth of planStepClock on this thread: the strategy it runs inside must not start it again.
thread_local int step_clock_depth = 0;

int nextPow2(int d) {
  int p = 1;
  while (p < d) p <<= 1;
  return p;
}

// Ranks a sequence needs when every offloadable layer is offloaded (r = 1: two layers' activations
// stay resident), at least 1; D0 when offloading cannot help (l <= 2).
int ranksAllOffloaded(const CostModel& m, int64_t s, int64_t cap) {
  const int d0 = ranksWithoutOffload(m, s, cap);
  if (d0 <= 1 || m.layers <= 2) return d0;
  const double need = 2.0 * m.act(static_cast<double>(s)) / (m.layers * m.act(static_cast<double>(cap)));
  return std::max(1, static_cast<int>(std::ceil(need - 1e-12)));
}

// Whether every sequence fits the world without offloading (mirrors Context's check).
bool fitsWithoutOffload(const detail::Context& ctx) {
  for (int64_t i : ctx.order) {
    const int64_t s = ctx.len[i];
    if (s <= ctx.cap_max) break;
    if (ranksWithoutOffload(ctx.opt.cost, s, ctx.cap_min) > ctx.W) return false;
  }
  return true;
}

}  // namespace

namespace detail {

bool insideStepClock() { return step_clock_depth > 0; }

Plan planStepClock(const Context& ctx, const BoundParts& bound) {
  const PlanOptions& opt = ctx.opt;
  const Strategy strategy = opt.strategy;
  if (strategy != Strategy::kNaive && strategy != Strategy::kPow2) {
    // Strategies that size rings by time already: with the rule's floors, and without offloading.
    struct Depth {
      Depth() { ++step_clock_depth; }
      ~Depth() { --step_clock_depth; }
    };
    Plan with = [&] {
      Depth d;
      return makePlan(ctx.len, opt);
    }();
    if (!fitsWithoutOffload(ctx)) return with;
    PlanOptions off = opt;
    off.offload = false;
    Plan without = makePlan(ctx.len, off);
    return with.makespan < without.makespan ? std::move(with) : std::move(without);
  }
  const CostModel& cm = opt.cost;
  const int W = ctx.W;
  const bool pow2 = strategy == Strategy::kPow2;
  auto shape = [&](int d) { return pow2 ? std::min(nextPow2(d), W) : std::min(d, W); };
  // Per long sequence: its reference (no-offload) size and the allowed smaller sizes, ascending.
  const size_t n = ctx.len.size();
  std::vector<int> ref(n, 1), sizes;
  std::vector<int64_t> longs;
  std::vector<std::vector<int>> allowed;  // per entry of longs: sizes below the reference
  for (int64_t i : ctx.order) {
    const int64_t s = ctx.len[i];
    if (s <= ctx.cap_min) break;
    ref[i] = shape(ranksWithoutOffload(cm, s, ctx.cap_min));
    const int lo = shape(offloadFloor(opt, s, ctx.cap_min).ranks);
    std::vector<int> a;
    for (int d = lo; d < ref[i]; d = pow2 ? d * 2 : d + 1) a.push_back(d);
    longs.push_back(i);
    allowed.push_back(std::move(a));
  }
  // Builder holds a reference (not assignable): candidates live behind pointers.
  auto best = std::make_unique<Builder>(tokenBalanced(ctx, strategy, &ref));
  const double T = best->ringsFirstStep();
  double best_t = T;
  std::vector<int> last = ref;
  for (double clock = T; clock > T * 1e-3; clock *= kClockStep) {
    sizes = ref;
    for (size_t k = 0; k < longs.size(); ++k) {
      const double s = static_cast<double>(ctx.len[longs[k]]);
      for (int d : allowed[k])
        if (cm.shardedTime(s, d) / ctx.speed_min <= clock) {
          sizes[longs[k]] = d;
          break;
        }
    }
    if (sizes == last) {
      if (sizes == ref) break;  // every smaller clock keeps the reference sizes too
      continue;
    }
    last = sizes;
    auto b = std::make_unique<Builder>(tokenBalanced(ctx, strategy, &sizes));
    const double t = b->ringsFirstStep();
    if (t < best_t * (1 - 1e-9)) {
      best_t = t;
      best = std::move(b);
    }
  }
  return best->finish(bound);
}

}  // namespace detail

std::vector<RingChoice> explainRings(const Plan& p, const std::vector<int64_t>& lengths,
                                     const PlanOptions& opt) {
  if (p.num_sequences != static_cast<int64_t>(lengths.size()))
    throw std::invalid_argument("explainRings: the plan has " + std::to_string(p.num_sequences) +
                                " sequences, lengths has " + std::to_string(lengths.size()));
  if (p.world_size != opt.world_size)
    throw std::invalid_argument("explainRings: the plan is for world_size " + std::to_string(p.world_size) +
                                ", the options say " + std::to_string(opt.world_size));
  const CostModel& cm = opt.cost;
  int64_t cap = rankCapacity(opt, 0);
  for (int r = 1; r < opt.world_size; ++r) cap = std::min(cap, rankCapacity(opt, r));
  std::vector<RingChoice> out(lengths.size());
  std::vector<char> in_ring(lengths.size(), 0);
  for (size_t i = 0; i < lengths.size(); ++i) out[i].seq = static_cast<int64_t>(i);
  for (int64_t m = 0; m < p.numMicroBatches(); ++m)
    for (int64_t k = p.mb_seg[m]; k < p.mb_seg[m + 1]; ++k) {
      RingChoice& c = out[p.seg_seq[k]];
      c.ranks = p.seg_ring_size[k];
      if (p.mb_ring[m] >= 0) {
        in_ring[p.seg_seq[k]] = 1;
        c.ratio = std::max(c.ratio, p.mb_offload[m]);
      }
    }
  const bool pow2 = p.strategy == "pow2";
  const bool fixed = p.strategy == "static";
  for (size_t i = 0; i < lengths.size(); ++i) {
    RingChoice& c = out[i];
    const int64_t s = lengths[i];
    c.floor_memory = ranksWithoutOffload(cm, s, cap);
    c.floor_offload = offloadFloor(opt, s, cap).ranks;
    if (!in_ring[i]) {
      c.reason = RingReason::kLocal;
      continue;
    }
    const int floor = c.floor_offload;
    const int shaped = fixed ? c.ranks
                             : pow2 ? std::min(nextPow2(floor), opt.world_size) : floor;
    if (c.ranks > shaped) {
      c.reason = RingReason::kStep;
    } else if (c.ranks > floor) {
      c.reason = RingReason::kShape;
    } else {
      const int all_off = opt.offload ? ranksAllOffloaded(cm, s, cap) : c.floor_memory;
      c.reason = floor > all_off ? RingReason::kCopyHiding : RingReason::kMemory;
    }
  }
  return out;
}

}  // namespace planner
}  // namespace bytescale
