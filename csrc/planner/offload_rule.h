// Offloading under the step's clock (pure C++, no torch).
//
// The paper's Eq. 3 (cost_model.h, solveOffload) minimises a long sequence's ring size D(s) subject
// to memory and to the copies hiding under that sequence's own compute. Nothing in it looks at the
// step: a 2M-token sequence on 16 ranks instead of 256 is allowed, and that ring then IS the step.
// Under PlanOptions::offload_rule = kStep (the default) the planner keeps Eq. 3 as the FLOOR of a
// sequence's ring size and lets offloading shrink a ring below its size without offloading only
// where the plan's replayed step does not grow:
//   naive, pow2  The reference is the strategy's own plan without offloading (every long sequence
//                on its no-offload ring, min(D0, world) with D0 = ranksWithoutOffload, pow2
//                rounded). Its replayed step T is the clock. For clocks c = T, 0.9 T, 0.81 T, ... each
//                long sequence takes the smallest allowed ring size d >= its Eq. 3 floor whose
//                ring time shardedTime(s, d) fits c (else its reference size); the plan is rebuilt
//                and replayed, and the shortest replay wins, the reference on ties. So the
//                result replays no longer than the strategy without offloading.
//   others       (balanced, ...) The strategy runs with Eq. 3 floors (it already sizes rings by
//                time) and without offloading; the shorter replay wins, no offloading on ties.
// A sequence that needs more than the world's ranks without offloading has no such reference:
// its reference ring is the whole world, at the ratio that makes it fit.
// kPaperEq3 keeps the literal rule: naive and pow2 put every long sequence on its Eq. 3 minimum.
//
// The copies hide per direction under the step rule: Eq. 3's r_max with T(s) replaced by the
// forward's share of it (kForwardShare, cost_model.h), since a layer's activations must leave
// while the forward runs and come back while the backward runs; the paper's rule hides them
// under the whole forward + backward time (the paper's floor is kept where the per-direction one
// needs more ranks than the world has). offloadFloor is the floor every strategy uses.
//
// explainRings says, per sequence, which constraint set its ring size (and so its ratio, the
// smallest that fits that size: ratioForRanks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/planner.h"

namespace bytescale {
namespace planner {

enum class RingReason : int8_t {
  kLocal = 0,       // "local": the sequence fits one rank; no ring, no offloading
  kMemory = 1,      // "memory": the memory floor (without offloading: D0; with it: even offloading
                    //   every offloadable layer, only two stay resident, needs this many ranks)
  kCopyHiding = 2,  // "copy-hiding": a smaller ring would need a ratio whose copies do not hide
                    //   under the sequence's compute (Eq. 3's T(s) >= Act(s) r / B)
  kStep = 3,        // "step": memory and copies allow a smaller ring, but it would lengthen the
                    //   step (the step's clock), or the strategy sized it by time (balanced)
  kShape = 4,       // "shape": the strategy's ring-size rule rounded it up (pow2: a power of two;
                    //   static: the step's CP degree)
};
std::string ringReasonName(RingReason r);

// The fewest ranks (and the ratio there) a sequence of s tokens may use at per-rank capacity
// `capacity` under opt.offload and opt.offload_rule (without offloading: ranksWithoutOffload).
OffloadChoice offloadFloor(const PlanOptions& opt, int64_t s, int64_t capacity);

struct RingChoice {
  int64_t seq = 0;
  int ranks = 1;           // ring size in the plan (1: local)
  double ratio = 0;        // offload ratio of its ring micro-batches
  int floor_memory = 1;    // ranks without offloading (D0 = ranksWithoutOffload)
  int floor_offload = 1;   // Eq. 3's minimum (solveOffload) when offloading, else D0
  RingReason reason = RingReason::kLocal;
};

// One entry per sequence (input order). `opt` must be the options the plan was made with.
std::vector<RingChoice> explainRings(const Plan& p, const std::vector<int64_t>& lengths,
                                     const PlanOptions& opt);

}  // namespace planner
}  // namespace bytescale
