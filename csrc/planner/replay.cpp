#include "planner/replay.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace bytescale {
namespace planner {

ScheduleView scheduleOf(const Plan& p) {
  if (p.mb_ring.size() != p.mb_tokens.size() || p.ring_grp.empty() ||
      static_cast<int>(p.rank_mb.size()) != p.world_size + 1)
    throw std::invalid_argument("replay: the plan's arrays are inconsistent (rank_mb " +
                                std::to_string(p.rank_mb.size()) + ", mb_ring " +
                                std::to_string(p.mb_ring.size()) + ", ring_grp " +
                                std::to_string(p.ring_grp.size()) + " entries for " +
                                std::to_string(p.mb_tokens.size()) + " micro-batches, world " +
                                std::to_string(p.world_size) + ")");
  ScheduleView v;
  v.world_size = p.world_size;
  v.rank_mb = p.rank_mb.data();
  v.num_mb = p.numMicroBatches();
  v.mb_ring = p.mb_ring.data();
  v.num_rings = p.numRings();
  v.ring_grp = p.ring_grp.data();
  v.grp_ranks = p.grp_ranks.data();
  v.num_grp_ranks = static_cast<int64_t>(p.grp_ranks.size());
  return v;
}

namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("replay: " + what); }

void validate(const ScheduleView& s) {
  const int W = s.world_size;
  const int64_t M = s.num_mb, R = s.num_rings;
  if (W < 1) bad("world_size must be >= 1, got " + std::to_string(W));
  if (M < 0 || R < 0) bad("negative number of micro-batches or rings");
  if (s.rank_mb[0] != 0) bad("rank_mb[0] = " + std::to_string(s.rank_mb[0]) + ", expected 0");
  for (int r = 0; r < W; ++r)
    if (s.rank_mb[r + 1] < s.rank_mb[r])
      bad("rank_mb decreases at rank " + std::to_string(r) + " (" + std::to_string(s.rank_mb[r]) +
          " -> " + std::to_string(s.rank_mb[r + 1]) + ")");
  if (s.rank_mb[W] != M)
    bad("rank_mb[world_size] = " + std::to_string(s.rank_mb[W]) + " but there are " +
        std::to_string(M) + " micro-batches");
  for (int64_t m = 0; m < M; ++m)
    if (s.mb_ring[m] < -1 || s.mb_ring[m] >= R)
      bad("micro-batch " + std::to_string(m) + " has ring id " + std::to_string(s.mb_ring[m]) +
          " outside [-1, " + std::to_string(R) + ")");
  if (s.ring_grp[0] != 0) bad("ring_grp[0] = " + std::to_string(s.ring_grp[0]) + ", expected 0");
  for (int64_t k = 0; k < R; ++k)
    if (s.ring_grp[k + 1] <= s.ring_grp[k])
      bad("ring " + std::to_string(k) + " has an empty group (ring_grp must increase)");
  if (s.ring_grp[R] != s.num_grp_ranks)
    bad("ring_grp[num_rings] = " + std::to_string(s.ring_grp[R]) + " but grp_ranks has " +
        std::to_string(s.num_grp_ranks) + " entries");
  for (int64_t k = 0; k < s.num_grp_ranks; ++k)
    if (s.grp_ranks[k] < 0 || s.grp_ranks[k] >= W)
      bad("grp_ranks[" + std::to_string(k) + "] = " + std::to_string(s.grp_ranks[k]) +
          " outside [0, " + std::to_string(W) + ")");
}

std::string rankList(const std::vector<int>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size() && i < 8; ++i) os << (i ? ", " : "") << v[i];
  if (v.size() > 8) os << ", ... (" << v.size() << " ranks)";
  os << "]";
  return os.str();
}

// The replay engine: one pass over every rank's list; a ring completes when its last member
// arrives, which releases every member. Linear in micro-batches plus group entries.
ReplayResult run(const ScheduleView& s, const double* dur) {
  const int W = s.world_size;
  const int64_t M = s.num_mb, R = s.num_rings;
  ReplayResult out;
  out.mb_start.assign(M, 0.0);
  out.mb_end.assign(M, 0.0);
  out.rank_finish.assign(W, 0.0);
  out.rank_busy.assign(W, 0.0);
  std::vector<int> rank_of(M);
  for (int r = 0; r < W; ++r)
    for (int64_t m = s.rank_mb[r]; m < s.rank_mb[r + 1]; ++m) rank_of[m] = r;
  // Per ring: arrivals, the latest arrival time, the largest duration and the arrived
  // micro-batches (a list linked through `next`).
  std::vector<int32_t> arrived(R, 0);
  std::vector<int64_t> first(R, -1), next(M, -1);
  std::vector<double> tmax(R, 0.0), dmax(R, 0.0);
  std::vector<int64_t> head(s.rank_mb, s.rank_mb + W);
  std::vector<double>& t = out.rank_finish;  // a rank's clock: when it is free
  std::vector<int64_t> mark(W, -1);
  std::vector<int> todo(W);
  for (int r = 0; r < W; ++r) todo[r] = W - 1 - r;
  while (!todo.empty()) {
    const int r = todo.back();
    todo.pop_back();
    while (head[r] < s.rank_mb[r + 1]) {
      const int64_t m = head[r];
      const int64_t id = s.mb_ring[m];
      if (id < 0) {  // local
        out.mb_start[m] = t[r];
        t[r] += dur[m];
        out.mb_end[m] = t[r];
        out.rank_busy[r] += dur[m];
        ++head[r];
        continue;
      }
      const int64_t g0 = s.ring_grp[id], size = s.ring_grp[id + 1] - g0;
      if (arrived[id] == 0) {
        tmax[id] = t[r];
        dmax[id] = dur[m];
      } else {
        tmax[id] = std::max(tmax[id], t[r]);
        dmax[id] = std::max(dmax[id], dur[m]);
      }
      if (arrived[id] >= size)
        bad("ring " + std::to_string(id) + " has more micro-batches than its " +
            std::to_string(size) + " members (micro-batch " + std::to_string(m) + " on rank " +
            std::to_string(r) + ")");
      next[m] = first[id];
      first[id] = m;
      if (++arrived[id] < size) break;  // blocked until the last member arrives
      // Complete: the arrived ranks must be exactly the group's members.
      for (int64_t k = g0; k < g0 + size; ++k) mark[s.grp_ranks[k]] = id;
      for (int64_t q = first[id]; q >= 0; q = next[q]) {
        const int rr = rank_of[q];
        if (mark[rr] != id) {
          std::vector<int> grp(s.grp_ranks + g0, s.grp_ranks + g0 + size);
          bad("rank " + std::to_string(rr) + " runs ring " + std::to_string(id) +
              " (micro-batch " + std::to_string(q) + ") but is not in its group " + rankList(grp) +
              " (or holds it twice)");
        }
        mark[rr] = -1;
      }
      const double st = tmax[id], en = st + dmax[id];
      for (int64_t q = first[id]; q >= 0; q = next[q]) {
        const int rr = rank_of[q];
        out.mb_start[q] = st;
        out.mb_end[q] = en;
        out.rank_busy[rr] += en - st;
        t[rr] = en;
        ++head[rr];
        if (rr != r) todo.push_back(rr);
      }
    }
  }
  // Anything left is a deadlock (or a ring some member never lists): report the blocked ranks,
  // their rings and who is missing.
  std::vector<int> blocked;
  for (int r = 0; r < W; ++r)
    if (head[r] < s.rank_mb[r + 1]) blocked.push_back(r);
  if (!blocked.empty()) {
    std::ostringstream os;
    os << "the micro-batch order deadlocks (" << blocked.size() << " ranks blocked):";
    for (size_t i = 0; i < blocked.size() && i < 4; ++i) {
      const int r = blocked[i];
      const int64_t m = head[r], id = s.mb_ring[m];
      const int64_t g0 = s.ring_grp[id], g1 = s.ring_grp[id + 1];
      std::vector<int> missing;
      for (int64_t q = first[id]; q >= 0; q = next[q]) mark[rank_of[q]] = id;
      for (int64_t k = g0; k < g1; ++k)
        if (mark[s.grp_ranks[k]] != id) missing.push_back(s.grp_ranks[k]);
      for (int64_t q = first[id]; q >= 0; q = next[q]) mark[rank_of[q]] = -1;
      os << " rank " << r << " waits in ring " << id << " (micro-batch " << m << ") for ranks "
         << rankList(missing);
      if (!missing.empty()) {
        const int x = missing[0];
        if (head[x] < s.rank_mb[x + 1] && s.mb_ring[head[x]] >= 0)
          os << ", rank " << x << " waits in ring " << s.mb_ring[head[x]];
        else if (head[x] >= s.rank_mb[x + 1])
          os << ", rank " << x << " finished without running it";
      }
      os << ";";
    }
    os << " every member must list a ring's micro-batch, and list shared rings in the same"
          " relative order";
    bad(os.str());
  }
  double step = 0;
  for (int r = 0; r < W; ++r) step = std::max(step, t[r]);
  out.step_time = step;
  out.rank_idle.resize(W);
  for (int r = 0; r < W; ++r) out.rank_idle[r] = std::max(0.0, step - out.rank_busy[r]);
  return out;
}

}  // namespace

ReplayResult replay(const ScheduleView& s, const double* durations, int64_t num_durations) {
  validate(s);
  if (num_durations != s.num_mb)
    bad("got " + std::to_string(num_durations) + " durations for " + std::to_string(s.num_mb) +
        " micro-batches");
  for (int64_t m = 0; m < num_durations; ++m)
    if (!(durations[m] >= 0) || !std::isfinite(durations[m])) {
      std::ostringstream os;
      os << "duration of micro-batch " << m << " is " << durations[m]
         << " (must be finite and >= 0)";
      bad(os.str());
    }
  return run(s, durations);
}

ReplayResult replay(const Plan& plan, const std::vector<double>& durations) {
  const std::vector<double>& d = durations.empty() ? plan.mb_cost : durations;
  if (durations.empty() && plan.mb_cost.size() != plan.mb_tokens.size())
    bad("the plan has " + std::to_string(plan.mb_cost.size()) + " costs for " +
        std::to_string(plan.mb_tokens.size()) + " micro-batches");
  return replay(scheduleOf(plan), d.data(), static_cast<int64_t>(d.size()));
}

LockstepSlots lockstepSlots(const ScheduleView& s) {
  validate(s);
  const int W = s.world_size;
  const int64_t M = s.num_mb;
  // Rings take one slot each and locals none: a ring's slot is its start in this replay.
  std::vector<double> unit(M);
  for (int64_t m = 0; m < M; ++m) unit[m] = s.mb_ring[m] >= 0 ? 1.0 : 0.0;
  ReplayResult rings = run(s, unit.data());
  // Each rank: its rings' slots (increasing along its list), locals into the free slots in order.
  std::vector<int64_t> slot_of(M, -1);
  int64_t total = 0;
  for (int r = 0; r < W; ++r) {
    std::vector<int64_t> taken;
    for (int64_t m = s.rank_mb[r]; m < s.rank_mb[r + 1]; ++m)
      if (s.mb_ring[m] >= 0) {
        slot_of[m] = static_cast<int64_t>(std::llround(rings.mb_start[m]));
        taken.push_back(slot_of[m]);
      }
    size_t ti = 0;
    int64_t k = 0;
    for (int64_t m = s.rank_mb[r]; m < s.rank_mb[r + 1]; ++m) {
      if (s.mb_ring[m] >= 0) continue;
      while (ti < taken.size() && taken[ti] < k) ++ti;
      while (ti < taken.size() && taken[ti] == k) {
        ++k;
        ++ti;
      }
      slot_of[m] = k++;
    }
    total = std::max(total, k);
    if (!taken.empty()) total = std::max(total, taken.back() + 1);
  }
  LockstepSlots out;
  out.world_size = W;
  out.num_slots = total;
  out.mb.assign(static_cast<size_t>(W) * static_cast<size_t>(total), -1);
  for (int r = 0; r < W; ++r)
    for (int64_t m = s.rank_mb[r]; m < s.rank_mb[r + 1]; ++m)
      out.mb[static_cast<size_t>(r) * total + slot_of[m]] = m;
  return out;
}

LockstepSlots lockstepSlots(const Plan& plan) { return lockstepSlots(scheduleOf(plan)); }

void checkSchedule(const ScheduleView& s) { validate(s); }

}  // namespace planner
}  // namespace bytescale
