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

// Flat (structure-of-arrays) plan, cheap to serialise and to expose to Python without copies.
struct Plan {
  int world_size = 0;
  std::string strategy;  // the strategy that built this plan ("pow2" when balanced kept pow2's)
  // rank r's micro-batches are [rank_mb[r], rank_mb[r+1]), in execution order
  std::vector<int64_t> rank_mb;
  // micro-batch m: segments [mb_seg[m], mb_seg[m+1])
  std::vector<int64_t> mb_seg;
  std::vector<double> mb_offload;  // offload ratio r of the micro-batch (0 = none)
  std::vector<double> mb_cost;     // predicted time on its rank (seconds)
  std::vector<int64_t> mb_tokens;  // tokens held by the rank in this micro-batch
  std::vector<int64_t> mb_ring;    // ring id of a ring micro-batch (0 .. rings-1), -1: local
  // ring k (one entry per ring, shared by its members' micro-batches): its group, in ring order,
  // is grp_ranks[ring_grp[k] .. ring_grp[k+1]). Ring ids give the global ring order.
  std::vector<int64_t> ring_grp;
  std::vector<int32_t> grp_ranks;
  // segment k: sequence index (position in the input), ring size, ring position, tokens held
  std::vector<int64_t> seg_seq;
  std::vector<int32_t> seg_ring_size;
  std::vector<int32_t> seg_ring_pos;
  std::vector<int64_t> seg_tokens;
  // predictions (cost model; the replay of csrc/planner/replay.h with durations = mb_cost)
  std::vector<double> rank_cost;    // busy time: sum of the rank's micro-batch costs
  std::vector<double> rank_finish;  // when the rank finishes its last micro-batch (replayed)
  std::vector<double> rank_idle;    // makespan - rank_cost: waits for ring partners + tail
  double makespan = 0;              // synchronised step time: max of rank_finish
  double max_busy = 0;              // max of rank_cost (the step if ranks never waited)
  double mean_cost = 0;             // mean of rank_cost
  double imbalance = 1;             // makespan / mean_cost
  double lower_bound = 0;           // max of the parts below: no plan can beat it (bound.h)
  double bound_work = 0;            // total work / total speed
  double bound_piece = 0;           // largest indivisible piece (best ring size, comm included)
  double bound_waves = 0;           // wide rings that cannot all run at once
  int64_t num_sequences = 0;
  // Pipelines (pipeline.h): the depth the plan was made for, the forward share its replay used, and
  // per micro-batch its schedule slot in its pipeline (increasing along the pipeline's list; gaps
  // are empty slots; a ring's members hold it at the same slot) and its stage-to-stage transfer
  // time. mb_slot / mb_p2p are empty for a plan without pipelines (pp == 1 and no pp-* strategy).
  int pp = 1;
  double pp_fwd_share = 1.0 / 3;
  std::vector<int64_t> mb_slot;
  std::vector<double> mb_p2p;

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
