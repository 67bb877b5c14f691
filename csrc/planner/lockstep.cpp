// The expert-parallel forms of the lockstep slots and their replay (replay.h): locals sorted by
// cost, the slots of each EP block, and the replay of a step in which EP blocks advance slot by
// slot together.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "planner/replay.h"

namespace bytescale {
namespace planner {

namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument(what); }

void checkSlots(const LockstepSlots& slots, const char* who) {
  if (slots.world_size < 0 || slots.num_slots < 0 ||
      slots.mb.size() != static_cast<size_t>(slots.world_size) * static_cast<size_t>(slots.num_slots))
    bad(std::string(who) + ": the slots' shape does not match their " + std::to_string(slots.mb.size()) +
        " entries");
}

}  // namespace

void sortLocalSlots(LockstepSlots& slots, const int64_t* mb_ring, const double* cost, int64_t num_mb) {
  checkSlots(slots, "sortLocalSlots");
  for (int64_t m = 0; m < num_mb; ++m)
    if (std::isnan(cost[m])) bad("sortLocalSlots: the cost of micro-batch " + std::to_string(m) + " is NaN");
  std::vector<int64_t> pos, mbs;
  for (int u = 0; u < slots.world_size; ++u) {
    int64_t* row = slots.mb.data() + static_cast<size_t>(u) * slots.num_slots;
    pos.clear();
    mbs.clear();
    for (int64_t k = 0; k < slots.num_slots; ++k) {
      const int64_t m = row[k];
      if (m < -1 || m >= num_mb)
        bad("sortLocalSlots: slot " + std::to_string(k) + " of row " + std::to_string(u) + " holds " +
            std::to_string(m) + ", outside [-1, " + std::to_string(num_mb) + ")");
      if (m >= 0 && mb_ring[m] < 0) {
        pos.push_back(k);
        mbs.push_back(m);
      }
    }
    std::sort(mbs.begin(), mbs.end(),
              [cost](int64_t a, int64_t b) { return cost[a] > cost[b] || (cost[a] == cost[b] && a < b); });
    for (size_t i = 0; i < pos.size(); ++i) row[pos[i]] = mbs[i];
  }
}

std::vector<int64_t> groupSlotCounts(const LockstepSlots& slots, int group) {
  checkSlots(slots, "groupSlotCounts");
  if (group < 0) bad("groupSlotCounts: group must be >= 0, got " + std::to_string(group));
  const int W = slots.world_size;
  std::vector<int64_t> out(W, slots.num_slots);
  if (group == 0) return out;
  for (int b = 0; b < W; b += group) {
    const int e = std::min(W, b + group);
    int64_t last = -1;
    for (int u = b; u < e; ++u)
      for (int64_t k = slots.num_slots - 1; k > last; --k)
        if (slots.at(u, k) >= 0) {
          last = k;
          break;
        }
    for (int u = b; u < e; ++u) out[u] = last + 1;
  }
  return out;
}

LockstepSlots groupLockstep(const ScheduleView& s, int group, const double* cost, int64_t num_cost) {
  if (group < 1 || s.world_size % group)
    bad("group_lockstep: group " + std::to_string(group) + " does not divide the " +
        std::to_string(s.world_size) + " HDP units");
  if (num_cost != s.num_mb)
    bad("group_lockstep: got " + std::to_string(num_cost) + " costs for " + std::to_string(s.num_mb) +
        " micro-batches");
  LockstepSlots out = lockstepSlots(s);
  sortLocalSlots(out, s.mb_ring, cost, s.num_mb);
  return out;
}

LockstepSlots groupLockstep(const Plan& plan, int group) {
  return groupLockstep(scheduleOf(plan), group, plan.mb_cost.data(), static_cast<int64_t>(plan.mb_cost.size()));
}

ReplayResult epSlotReplay(const LockstepSlots& slots, int group, const ScheduleView& s, const double* d,
                          int64_t num_durations) {
  checkSchedule(s);
  checkSlots(slots, "ep_slot_replay");
  const int W = s.world_size;
  const int64_t M = s.num_mb, S = slots.num_slots;
  if (group < 1 || W % group)
    bad("ep_slot_replay: group " + std::to_string(group) + " does not divide the " + std::to_string(W) +
        " HDP units");
  bool ok = num_durations == M;
  for (int64_t m = 0; ok && m < M; ++m) ok = std::isfinite(d[m]) && d[m] >= 0;
  if (!ok) bad("ep_slot_replay: need " + std::to_string(M) + " finite durations >= 0");
  if (slots.world_size != W)
    bad("ep_slot_replay: the slots have " + std::to_string(slots.world_size) + " rows for " +
        std::to_string(W) + " units");
  std::vector<int> unit_of(M);
  for (int u = 0; u < W; ++u)
    for (int64_t m = s.rank_mb[u]; m < s.rank_mb[u + 1]; ++m) unit_of[m] = u;
  for (int u = 0; u < W; ++u)
    for (int64_t k = 0; k < S; ++k) {
      const int64_t m = slots.at(u, k);
      if (m < -1 || m >= M || (m >= 0 && unit_of[m] != u))
        bad("ep_slot_replay: slot " + std::to_string(k) + " of unit " + std::to_string(u) + " holds " +
            std::to_string(m) + ", not one of the unit's micro-batches");
    }
  const std::vector<int64_t> counts = groupSlotCounts(slots, group);
  const int B = W / group;
  ReplayResult out;
  out.mb_start.assign(M, 0.0);
  out.mb_end.assign(M, 0.0);
  out.rank_busy.assign(W, 0.0);
  std::vector<double>& ready = out.rank_finish;
  ready.assign(W, 0.0);
  // Per slot: blocks joined by the slot's rings (union-find over blocks), then each component
  // starts when its last unit is ready and lasts as long as its slowest micro-batch.
  std::vector<int> parent(B);
  std::vector<int64_t> ring_stamp(s.num_rings, -1), comp_stamp(B, -1);
  std::vector<int> ring_first(s.num_rings, 0);
  std::vector<double> comp_t0(B, 0.0), comp_d(B, 0.0);
  auto find = [&parent](int b) {
    while (parent[b] != b) {
      parent[b] = parent[parent[b]];
      b = parent[b];
    }
    return b;
  };
  for (int64_t k = 0; k < S; ++k) {
    for (int b = 0; b < B; ++b) parent[b] = b;
    for (int u = 0; u < W; ++u) {
      const int64_t m = slots.at(u, k);
      if (m < 0 || k >= counts[u] || s.mb_ring[m] < 0) continue;
      const int64_t r = s.mb_ring[m];
      if (ring_stamp[r] != k) {
        ring_stamp[r] = k;
        ring_first[r] = u;
      } else {
        const int a = find(u / group), c = find(ring_first[r] / group);
        if (a != c) parent[a] = c;
      }
    }
    for (int u = 0; u < W; ++u) {
      if (k >= counts[u]) continue;
      const int c = find(u / group);
      const int64_t m = slots.at(u, k);
      if (comp_stamp[c] != k) {
        comp_stamp[c] = k;
        comp_t0[c] = ready[u];
        comp_d[c] = 0.0;
      } else {
        comp_t0[c] = std::max(comp_t0[c], ready[u]);
      }
      if (m >= 0) comp_d[c] = std::max(comp_d[c], d[m]);
    }
    for (int u = 0; u < W; ++u) {
      if (k >= counts[u]) continue;
      const int c = find(u / group);
      const double t0 = comp_t0[c], t1 = t0 + comp_d[c];
      const int64_t m = slots.at(u, k);
      if (m >= 0) {
        out.mb_start[m] = t0;
        out.mb_end[m] = t1;
        out.rank_busy[u] += d[m];
      }
      ready[u] = t1;
    }
  }
  double step = 0.0;
  for (int u = 0; u < W; ++u) step = u ? std::max(step, ready[u]) : ready[u];
  out.step_time = step;
  out.rank_idle.resize(W);
  for (int u = 0; u < W; ++u) out.rank_idle[u] = step - out.rank_busy[u];
  return out;
}

ReplayResult epReplay(const Plan& plan, int group, const std::vector<double>& durations) {
  const std::vector<double>& d = durations.empty() ? plan.mb_cost : durations;
  return epSlotReplay(groupLockstep(plan, group), group, scheduleOf(plan), d.data(), static_cast<int64_t>(d.size()));
}

}  // namespace planner
}  // namespace bytescale
