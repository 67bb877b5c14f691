// Pipelines of HDP units: the 1F1B schedule of a pipelined plan, its replay, and the checks a
// runtime needs (pure C++, no torch).
//
// Layout (bytescale.init_mesh: pp x hdp x tp, TP innermost). With P stages, the HDP pool of a
// stage is its units; pipeline h is unit h of every stage. A pipelined plan has world_size =
// pipelines and lists, per pipeline, its micro-batches with a schedule SLOT each (Plan::mb_slot,
// increasing along the list; a gap is an empty slot that no stage runs). A micro-batch runs on all
// P stages of its pipeline; a ring micro-batch of d pipelines runs at every stage on those d
// pipelines' units, at the same slot on all of them. Pipelines sharing rings form a cohort; a
// pipeline with only local micro-batches may hold any number of slots.
//
// The schedule of one stage (1F1B, PipeDream-flush / Megatron's non-interleaved schedule): with S
// slots, stage p (0-based) runs w = min(P - 1 - p, S) warm-up forwards F(0) .. F(w-1), then
// alternates F(w + i), B(i) for i < S - w, then the cool-down backwards B(S - w) .. B(S - 1); the
// operations of empty slots are skipped (oneFOneB()). F(k) at stage p > 0 starts after F(k) at
// p - 1 and a P2P transfer; B(k) at p < P - 1 after B(k) at p + 1 and a transfer; a ring's F(k)
// (or B(k)) at stage p starts when every member pipeline's unit at p is ready for it and ends on
// all of them at start + the largest member's duration (the ring advances at its slowest member).
// The step ends when the last operation does (the gradient reduction after it is not modelled).
//
// Why every such plan is deadlock-free: number the operations of a pipeline with S slots in the
// 1F1B order above. For any S' >= S, that order is a subsequence of the order of S' slots (a
// forward or backward of slot k keeps its position relative to every other operation of the
// shorter list, warm-up forwards included), so every pipeline's stage order embeds into the
// order of one canonical pipeline of S_max slots; cross-stage dependencies map to the canonical
// pipeline's dependencies, and a ring joins operations with the same (stage, direction, slot),
// i.e. the same canonical operation. The canonical 1F1B dependency graph is acyclic, so the joined
// graph is too: no deadlock, whatever the pipelines' counts, when rings sit at common slots.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "planner/bound.h"
#include "planner/planner.h"
#include "planner/replay.h"

namespace bytescale {
namespace planner {

// The arrays of a pipelined schedule (not owned): a ScheduleView over the pipelines plus slots.
struct PipelineView {
  ScheduleView sched;                // world_size = pipelines
  int stages = 1;                    // P
  const int64_t* mb_slot = nullptr;  // sched.num_mb entries
};

PipelineView pipelineOf(const Plan& plan);

struct PipelineReplay {
  int pipelines = 0, stages = 1;
  // per micro-batch and stage (index m * stages + p)
  std::vector<double> fwd_start, fwd_end, bwd_start, bwd_end;
  std::vector<double> pipe_finish;  // per pipeline: end of its last operation (0 if it has none)
  std::vector<double> stage_busy;   // per pipeline and stage (index h * stages + p): time inside
                                    // operations (a ring counts start .. end on every member)
  double step_time = 0;             // max of pipe_finish
  // Idle share of the step over every stage's unit: 1 - sum(stage_busy) / (pipelines x stages x
  // step_time): pipeline bubbles, waits for ring partners and transfers, pipelines ending early.
  double bubble = 0;
};

// Replays a pipelined schedule. fwd, bwd: [num_mb x stages] seconds (index m * stages + p); p2p:
// [num_mb] seconds to move micro-batch m's activations (forward) or their gradients (backward)
// across one stage boundary. Throws std::invalid_argument on malformed input (slots not increasing
// along a pipeline, a ring whose members hold it at different slots, a bad duration, ...) and on a
// deadlock (impossible for well-formed input, see the file comment; reported, never a hang).
PipelineReplay replayPipeline(const PipelineView& v, const double* fwd, const double* bwd,
                              const double* p2p, int64_t num_durations);
// The same replay into `out`, reusing `scratch`'s buffers and `out`'s between calls (a planner
// replays thousands of candidate schedules per step). checked = false skips the validation of the
// arrays and durations: only for schedules the caller built well-formed itself (a deadlock is
// still reported). Results are identical to replayPipeline's.
struct ReplayScratch {
  ReplayScratch();
  ~ReplayScratch();
  ReplayScratch(const ReplayScratch&) = delete;
  ReplayScratch& operator=(const ReplayScratch&) = delete;
  struct Buffers;
  std::unique_ptr<Buffers> buf;
};
void replayPipelineInto(const PipelineView& v, const double* fwd, const double* bwd, const double* p2p,
                        int64_t num_durations, PipelineReplay& out, ReplayScratch& scratch, bool checked = true);
// A pipelined plan with its own predictions: at every stage fwd = pp_fwd_share x mb_cost, bwd = the
// rest, p2p = mb_p2p.
PipelineReplay replayPipeline(const Plan& plan);

// The 1F1B operations of one stage of a pipeline with `slots` slots (none empty), in order:
// 2k = forward of slot k, 2k + 1 = its backward. Throws std::invalid_argument on bad values.
std::vector<int64_t> oneFOneB(int64_t slots, int stages, int stage);

// Throws std::invalid_argument naming both depths when a plan made for another pipeline depth is
// given to a runtime of `stages` stages (or stages < 1).
void checkPipelineDepth(const Plan& plan, int stages);

// The layers of one stage when `layers` are cut into `stages` equal stages; throws
// std::invalid_argument naming both numbers when the stages do not divide the layers (or either is
// < 1). CostModel::layers of a pipelined plan is this number.
int stageLayers(int layers, int stages);

// Throws std::invalid_argument naming the bad option (stages < 1, a forward share outside (0, 1),
// negative or non-finite transfer terms).
void validatePipelineOptions(const PipelineOptions& po);

namespace detail {
struct Context;

// The lower bound of a pipelined step from the flat one (same assignments, one stage's view):
//   work:  work + (P-1) c_min + 2 (P-1) latency: the busiest pipeline's last stage holds at least
//          the mean work; it cannot start before the first forward crossed P-1 stages nor end
//          before the last backward crosses them back, each micro-batch costing at least c_min
//          (the shortest sequence at its best ring size: sharded time only grows with length);
//   piece: P x piece + 2 (P-1) latency: the largest indivisible micro-batch's own chain, forward
//          through P stages and backward through them;
//   waves: unchanged (it holds for every stage's timeline).
BoundParts pipelineBound(const BoundParts& flat, const Context& ctx);

// Turns a finished flat plan into a pipelined one: slots (`slots`, per micro-batch, or empty to
// keep each pipeline's order and align every ring at the earliest slot all members reach), P2P
// times, pp, then the pipeline replay's makespan, finish, idle and the pipelined bound.
void finishPipeline(Plan& p, const Context& ctx, const BoundParts& flat_bound,
                    std::vector<int64_t> slots = {});

// Structure checks of a pipelined plan (Plan::checkStructure calls it): throws
// std::invalid_argument. Replay agreement: verifyPipeline (Plan::verify), std::logic_error.
void checkPipelineStructure(const Plan& p);
void verifyPipeline(const Plan& p, const PlanOptions& opt);

// Strategies (pp_balance.cpp, pp_layout.cpp; pp_balance.h): PP-Balance and Megatron's lockstep slots.
Plan planPPBalance(const Context& ctx, const BoundParts& flat_bound);

// The work of the calling thread's last planPPBalance (tests bound it; deterministic counts, not
// times): candidate layouts built (passes), those skipped as identical to an earlier one, pipeline
// replays run and their operations (micro-batches x stages summed over the replays), moves tried
// and kept by the balance step, and the one-pipeline replays that bound a move's step (bounds,
// bound_ops: micro-batches x stages) to skip the cohort's replay.
struct PPBalanceWork {
  int64_t passes = 0, passes_skipped = 0, replays = 0, replayed_ops = 0, trials = 0, moves = 0;
  int64_t bounds = 0, bound_ops = 0;
};
PPBalanceWork ppBalanceWork();
Plan planPPLockstep(const Context& ctx, const BoundParts& flat_bound);
}  // namespace detail

}  // namespace planner
}  // namespace bytescale
