// The step model of a flat plan (pure C++, no torch): its replay in the runtime's execution model,
// its FSDP2 lockstep slots, and their expert-parallel form (EP blocks) with its replay. Each reads
// one schedule view (ScheduleView: a plan's arrays, or a schedule built elsewhere, e.g. the
// simulator's); the 1F1B order and replay of a pipelined plan are pipeline.h's.
//
// The model of a step (what the runtime does and what the planner optimises):
//   * every rank runs its micro-batches one after another, exactly in the plan's per-rank order;
//   * a local micro-batch starts as soon as its rank is free;
//   * a ring micro-batch starts only when ALL members of its group have reached it (each member
//     is free), and ends on every member at start + the largest duration among its members' copies
//     (the ring advances in lockstep, so its slowest member sets the pace).
// The step ends when the last rank finishes. A rank's idle time is the step time minus the time it
// spends inside micro-batches (waiting for ring partners, and after its last micro-batch).
//
// Deadlock: if the members of a ring list it behind different rings (say rank 0 runs ring A then
// B, rank 1 runs B then A), neither ring can start. replay() detects this and throws
// std::invalid_argument naming the ranks and rings involved. Plans made by makePlan() never
// deadlock: every member lists a group's ring micro-batches in increasing global ring id.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/planner.h"

namespace bytescale {
namespace planner {

// The arrays of a plan the replay reads (not owned; the same layout as Plan's):
//   rank r's micro-batches are [rank_mb[r], rank_mb[r+1]) in execution order;
//   micro-batch m is local when mb_ring[m] == -1, else it belongs to ring mb_ring[m] (0 <= id <
//   num_rings), whose group is grp_ranks[ring_grp[id] .. ring_grp[id+1]); every member of that
//   group must hold exactly one micro-batch of the ring.
struct ScheduleView {
  int world_size = 0;
  const int64_t* rank_mb = nullptr;  // world_size + 1 entries
  int64_t num_mb = 0;
  const int64_t* mb_ring = nullptr;  // num_mb entries
  int64_t num_rings = 0;
  const int64_t* ring_grp = nullptr;  // num_rings + 1 entries
  const int32_t* grp_ranks = nullptr;
  int64_t num_grp_ranks = 0;
};

ScheduleView scheduleOf(const Plan& plan);

struct ReplayResult {
  std::vector<double> mb_start;     // per micro-batch (indexed like Plan::mb_cost)
  std::vector<double> mb_end;
  std::vector<double> rank_finish;  // end of each rank's last micro-batch (0 if it has none)
  std::vector<double> rank_busy;    // time inside micro-batches (a ring counts start..end)
  std::vector<double> rank_idle;    // step_time - rank_busy
  double step_time = 0;             // max over ranks of rank_finish
};

// Replays `plan` with per-micro-batch durations (indexed like plan.mb_cost, finite, >= 0);
// empty `durations` means plan.mb_cost. Throws std::invalid_argument on malformed input and on a
// deadlocking order (naming the waiting ranks and their rings). O(micro-batches + group entries).
ReplayResult replay(const Plan& plan, const std::vector<double>& durations = {});
ReplayResult replay(const ScheduleView& schedule, const double* durations, int64_t num_durations);

// FSDP2 lockstep: with sharded parameters every rank joins a collective in every forward and
// backward, so all ranks run their k-th micro-batch together ("slot" k). Ring micro-batches are
// placed, in the plan's ring order, in the earliest slot after the member's previous ring where all
// members are free (ring members meet in the same slot); each rank's local micro-batches fill its
// remaining slots in plan order; every rank is padded to the same number of slots.
struct LockstepSlots {
  int world_size = 0;
  int64_t num_slots = 0;
  std::vector<int64_t> mb;  // row-major [world_size][num_slots]: micro-batch index, -1 = empty slot
  int64_t at(int rank, int64_t slot) const { return mb[static_cast<size_t>(rank * num_slots + slot)]; }
};

// Throws std::invalid_argument on malformed input or an inconsistent ring order (as replay()).
LockstepSlots lockstepSlots(const Plan& plan);
LockstepSlots lockstepSlots(const ScheduleView& schedule);

// Throws std::invalid_argument naming the first problem when the arrays do not form a schedule
// (the checks replay() and lockstepSlots() run first).
void checkSchedule(const ScheduleView& schedule);

// ---- Expert parallelism (lockstep.cpp) ----------------------------------------------------------
// Under EP every unit of a block of `group` consecutive units (an EP group) joins the all-to-alls of
// every micro-batch, so a block's units advance slot by slot together.

// Each row's local micro-batches (mb_ring -1) permuted over the slots they occupy, costliest first
// (ties: the lower index); ring slots and padding stay. Any order of a rank's locals is a valid
// schedule (they have no partner). `cost` has one entry per micro-batch (no NaN).
void sortLocalSlots(LockstepSlots& slots, const int64_t* mb_ring, const double* cost, int64_t num_mb);

// Per unit: the slots its block of `group` units runs (the block's last used slot + 1; 0 when the
// block holds nothing); group 0: every slot. A last block shorter than `group` counts its own rows.
std::vector<int64_t> groupSlotCounts(const LockstepSlots& slots, int group);

// The EP lockstep slots: lockstepSlots() with each unit's locals sorted by `cost` (one entry per
// micro-batch), so that a slot, which lasts as long as its slowest member, joins micro-batches of
// like cost. Throws std::invalid_argument when `group` (>= 1) does not divide the world.
LockstepSlots groupLockstep(const ScheduleView& schedule, int group, const double* cost, int64_t num_cost);
LockstepSlots groupLockstep(const Plan& plan, int group);  // cost: plan.mb_cost

// Replay of lockstep `slots` ([units][slots], -1 = padding) under EP with blocks of `group`
// consecutive units: a block's units advance slot by slot together (and stop after the block's own
// last real slot, groupSlotCounts), a ring joins its members' blocks for its slot, and a slot lasts
// as long as the slowest micro-batch among the units it joins (a padding slot costs nothing itself
// but waits). rank_finish is each unit's end, rank_idle = step_time - rank_busy. Throws
// std::invalid_argument on a bad group, bad durations (finite, >= 0, one per micro-batch), or slots
// that do not hold each unit's own micro-batches.
ReplayResult epSlotReplay(const LockstepSlots& slots, int group, const ScheduleView& schedule,
                          const double* durations, int64_t num_durations);
// groupLockstep(plan, group) replayed with `durations` (empty: plan.mb_cost).
ReplayResult epReplay(const Plan& plan, int group, const std::vector<double>& durations = {});

}  // namespace planner
}  // namespace bytescale
