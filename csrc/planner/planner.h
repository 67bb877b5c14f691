// The HDP planner (pure C++, no torch): assigns one step's sequences to ranks.
//
// Output, per rank, an ordered list of micro-batches. A micro-batch is either
//   * a ring micro-batch: ONE sequence sharded over a dynamic group of D ranks (any integer D),
//     this rank holding zig-zag chunks (pos, 2D-1-pos) (csrc/common/zigzag.h), with the
//     offload ratio its activations need (the static baseline packs SEVERAL sequences into one
//     ring micro-batch, each sharded the same way over the same group); or
//   * a local micro-batch: whole sequences packed up to the rank's token capacity.
// A rank's list is its execution order (the runtime runs it as is). Local micro-batches may sit
// between ring ones; every member lists a group's ring micro-batches in increasing global ring id
// (Plan::mb_ring), which is what makes every order the planner emits deadlock-free.
//
// The model of a step the plan is optimised for and judged by (csrc/planner/replay.h): each rank
// runs its list in order, a ring micro-batch starts when all its members are free, the step ends
// when the last rank does. Plan::makespan is that synchronised step time, replayed with the cost
// model's predictions; Plan::rank_cost is each rank's busy time (the sum of its costs).
//
// Strategies:
//   naive    - the paper's Alg. 1: ranks per long sequence from memory (Eq. 3 with offloading,
//              under the step's clock unless PlanOptions::offload_rule says otherwise),
//              short sequences best-fit into capacity-sized bins, everything balanced by TOKENS;
//              rings first, locals after.
//   balanced - ours, sync-aware (balanced.cpp): places rings on a timeline of when each rank is
//              free, with ring sizes (any integer) chosen by cost so that members arrive together,
//              then fits local sequences into the waits and tails that remain, longest first;
//              keeps the pow2 plan when that replays shorter (Plan::strategy is then "pow2"); on
//              small instances, then searches list schedules (listsched.h) on a fixed budget.
//   pow2     - a Megatron-style dynamic CP baseline: like naive but D rounded up to a power of 2.
//   static   - the static DP x CP baseline (Megatron-LM / TransformerEngine context parallelism,
//              static_cp.cpp): one CP degree for the whole step (PlanOptions::static_cp, or the
//              smallest power of two whose capacity holds the longest sequence), world / CP
//              replicas of consecutive ranks, EVERY sequence sharded over its replica's CP group.
//              Sequences are packed first-fit decreasing into micro-batches of CP x capacity
//              tokens (the smallest rank capacity), dealt to replicas round-robin in the order the
//              bins were opened. At CP = 1 the micro-batches are local. No offloading.
//   pp-balance  - pipelines of HDP units (pipeline.h): PP-Balance, the paper's Alg. 2 / Fig. 12.
//   pp-lockstep - pipelines of HDP units, Megatron's lockstep slots (every pipeline the same count).
//
// Pipeline parallelism (PlanOptions::pipeline.stages = P > 1, or a pp-* strategy): world_size is
// the number of PIPELINES (the HDP units of one stage); every micro-batch of a pipeline runs through
// its P stages under 1F1B, a ring micro-batch on the same units of every stage at the same schedule
// slot (Plan::mb_slot) on all its member pipelines. makespan is then the pipeline replay's
// (csrc/planner/pipeline.h, bubbles included). Other strategies keep their per-rank order, slotted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/cost_model.h"

namespace bytescale {
namespace planner {

enum class Strategy { kNaive = 0, kBalanced = 1, kPow2 = 2, kStatic = 3, kPPBalance = 4, kPPLockstep = 5 };
Strategy parseStrategy(const std::string& name);
std::string strategyName(Strategy s);

// Pipeline parallelism (csrc/planner/pipeline.h). mb_cost stays one stage's forward + backward time
// (CostModel::layers = the layers of ONE stage); capacity stays tokens per micro-batch per unit
// (sized by the user for the micro-batches 1F1B keeps in flight).
struct PipelineOptions {
  int stages = 1;                    // P: pipeline depth (1: none)
  double fwd_share = 1.0 / 3;        // forward's share of a stage's forward + backward time
  double p2p_bytes_per_token = 8192; // activation bytes per token sent between stages (hidden x 2)
  double p2p_bw = 50e9;              // bytes/s of a stage-to-stage link
  double p2p_latency = 10e-6;        // s per transfer
  // Seconds to send `tokens` tokens of activations (or their gradients) across one stage boundary.
  double p2pTime(double tokens) const { return p2p_latency + p2p_bytes_per_token * tokens / p2p_bw; }
};
// How offloading (PlanOptions::offload) may shrink rings (csrc/planner/offload_rule.h):
//   kStep      "step": Eq. 3 under the step's clock (default). A sequence's ring may shrink below
//              its size without offloading only where the plan's replayed step does not grow: a
//              plan with offloading never replays longer than the same strategy's plan without.
//   kPaperEq3  "paper-eq3": the paper's literal Eq. 3, kept for the ablation: naive and pow2 put
//              every long sequence on its Eq. 3 minimum D(s), whatever that does to the step.
enum class OffloadRule { kStep = 0, kPaperEq3 = 1 };
OffloadRule parseOffloadRule(const std::string& name);
std::string offloadRuleName(OffloadRule r);

struct PlanOptions {
  int world_size = 1;
  int64_t capacity = 0;         // tokens per micro-batch per rank (before multipliers)
  std::vector<double> speed;    // per-rank relative speed (empty: all 1)
  std::vector<double> memory;   // per-rank capacity multiplier (empty: all 1)
  CostModel cost;
  bool offload = false;
  OffloadRule offload_rule = OffloadRule::kStep;  // how offloading may shrink rings (above)
  Strategy strategy = Strategy::kBalanced;
  // strategy static only: the CP degree (must divide world_size; 0: staticCpDegree of the step's
  // longest sequence at the smallest rank capacity).
  int static_cp = 0;
  PipelineOptions pipeline;
  // The peer budget K (csrc/planner/peer_budget.h): over any number of steps each rank exchanges
  // ring traffic with at most K distinct ranks (its ring neighbours). Rings are then intervals of
  // the rank order with hops of at most 2 positions (neighbours within r-2 .. r+2). 0: unbounded
  // (the plans of the planner before the budget, byte for byte); 1..3: refused; with
  // world_size - 1 <= K the budget cannot bind and plans are the unbounded ones.
  int peer_budget = 4;
};

// The plan's fields, written once: the Plan struct below, its byte format (plan.cpp: every field in
// this order, each from format version `since` on) and its Python attributes (csrc/bindings/planner.cpp:
// read-only, arrays as numpy views, with `doc`) are all generated from this list.
// X(type, name, default, since, doc)
#define BYTESCALE_PLAN_FIELDS(X)                                                                              \
  X(int32_t, world_size, 0, 2, "ranks (HDP units), or pipelines of a pipelined plan")                         \
  X(int64_t, num_sequences, 0, 2, "sequences in the input")                                                   \
  X(std::string, strategy, {}, 2, "the strategy that built this plan ('pow2' when balanced kept pow2's)")     \
  X(std::vector<int64_t>, rank_mb, {}, 2,                                                                     \
    "rank r's micro-batches are [rank_mb[r], rank_mb[r+1]), in execution order")                              \
  X(std::vector<int64_t>, mb_seg, {}, 2, "micro-batch m's segments are [mb_seg[m], mb_seg[m+1])")             \
  X(std::vector<double>, mb_offload, {}, 2, "offload ratio r of each micro-batch (0 = none)")                 \
  X(std::vector<double>, mb_cost, {}, 2, "predicted time of each micro-batch on its rank (seconds)")          \
  X(std::vector<int64_t>, mb_tokens, {}, 2, "tokens held by the rank in each micro-batch")                    \
  X(std::vector<int64_t>, mb_ring, {}, 2, "ring id of a ring micro-batch (0 .. rings-1), -1: local")          \
  X(std::vector<int64_t>, seg_seq, {}, 2, "segment k's sequence index (position in the input)")               \
  X(std::vector<int32_t>, seg_ring_size, {}, 2, "segment k's ring size")                                      \
  X(std::vector<int32_t>, seg_ring_pos, {}, 2, "segment k's ring position")                                   \
  X(std::vector<int64_t>, seg_tokens, {}, 2, "tokens segment k holds")                                        \
  X(std::vector<int64_t>, ring_grp, {}, 2,                                                                    \
    "ring k's group, in ring order, is grp_ranks[ring_grp[k] .. ring_grp[k+1]); ids give the global ring "    \
    "order")                                                                                                  \
  X(std::vector<int32_t>, grp_ranks, {}, 2, "the rings' members (see ring_grp)")                              \
  X(std::vector<double>, rank_cost, {}, 2, "busy time: the sum of the rank's micro-batch costs")              \
  X(std::vector<double>, rank_finish, {}, 2, "when the rank finishes its last micro-batch (replayed)")         \
  X(std::vector<double>, rank_idle, {}, 2, "makespan - rank_cost: waits for ring partners + tail")            \
  X(double, makespan, 0, 2, "synchronised step time (the replay's; a pipelined plan's: 1F1B's), seconds")     \
  X(double, max_busy, 0, 2, "max of rank_cost (the step if ranks never waited)")                              \
  X(double, mean_cost, 0, 2, "mean of rank_cost")                                                             \
  X(double, imbalance, 1, 2, "makespan / mean_cost")                                                          \
  X(double, lower_bound, 0, 2, "max of the bound's parts: no plan can beat it (bound.h)")                     \
  X(double, bound_work, 0, 2, "total work / total speed")                                                     \
  X(double, bound_piece, 0, 2, "the largest indivisible piece (best ring size, communication included)")      \
  X(double, bound_waves, 0, 2, "wide rings that cannot all run at once")                                      \
  X(int32_t, pp, 1, 3, "the pipeline depth the plan was made for (1: none)")                                  \
  X(double, pp_fwd_share, 1.0 / 3, 3, "the forward's share of a micro-batch in the pipeline replay")          \
  X(std::vector<int64_t>, mb_slot, {}, 3,                                                                     \
    "pipelined: each micro-batch's 1F1B slot in its pipeline (increasing along the pipeline's list; gaps "    \
    "are empty slots; a ring's members hold it at the same slot); empty without pipelines")                   \
  X(std::vector<double>, mb_p2p, {}, 3, "pipelined: each micro-batch's stage-to-stage transfer time")

// Flat (structure-of-arrays) plan, cheap to serialise and to expose to Python without copies. Its
// predictions come from the cost model and the replay of csrc/planner/replay.h with durations =
// mb_cost. Pipelines (pipeline.h): mb_slot / mb_p2p are empty for a plan without pipelines (pp == 1
// and no pp-* strategy).
struct Plan {
#define BYTESCALE_PLAN_MEMBER(type, name, init, since, doc) type name = init;
  BYTESCALE_PLAN_FIELDS(BYTESCALE_PLAN_MEMBER)
#undef BYTESCALE_PLAN_MEMBER

  bool pipelined() const { return !mb_slot.empty(); }
  int64_t numMicroBatches() const { return static_cast<int64_t>(mb_tokens.size()); }
  int64_t numRings() const { return ring_grp.empty() ? 0 : static_cast<int64_t>(ring_grp.size()) - 1; }

  // Throws std::invalid_argument naming the first problem if the arrays do not form a plan
  // (sizes, monotone offsets, indices in range, segment counts of ring micro-batches). Cheap;
  // deserialize() runs it, so a corrupt byte string is an error, never a crash later.
  void checkStructure() const;

  std::vector<uint8_t> serialize() const;
  static Plan deserialize(const uint8_t* data, size_t size);

  // Checks every invariant against the input (every token once, capacities after offload,
  // ring ids increasing along every rank's list, the replay's stats); throws std::logic_error
  // describing the first violation.
  void verify(const std::vector<int64_t>& lengths, const PlanOptions& opt) const;
};

// Throws std::invalid_argument on bad input (naming the value) and when a sequence cannot be
// placed even using every rank.
Plan makePlan(const std::vector<int64_t>& lengths, const PlanOptions& opt);

// The static baseline's CP degree: the smallest power of two `cp` with cp * capacity >= longest
// (1 for an empty batch). Throws std::invalid_argument naming the values when cp > world_size.
int staticCpDegree(int64_t longest, int64_t capacity, int world_size);

// Per-rank token capacity after the memory multiplier (at least 1).
int64_t rankCapacity(const PlanOptions& opt, int rank);

}  // namespace planner
}  // namespace bytescale
