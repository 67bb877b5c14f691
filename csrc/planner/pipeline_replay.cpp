// Pipelined plans, the step model: the 1F1B order of a stage, the pipeline replay and the
// structure checks of a plan's slots (pipeline.h). Plan building is pipeline.cpp.
#include "planner/pipeline.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bytescale {
namespace planner {

namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("pipeline replay: " + what); }

std::string num(int64_t v) { return std::to_string(v); }

// Checks the schedule arrays (the flat layout's and the slots) before the replay reads them.
void validate(const PipelineView& v) {
  const ScheduleView& s = v.sched;
  const int H = s.world_size;
  const int64_t M = s.num_mb, R = s.num_rings;
  if (v.stages < 1) bad("stages must be >= 1, got " + num(v.stages));
  if (H < 1) bad("pipelines (world_size) must be >= 1, got " + num(H));
  if (M < 0 || R < 0) bad("negative number of micro-batches or rings");
  if (!s.rank_mb || !s.ring_grp || (M > 0 && (!s.mb_ring || !v.mb_slot)))
    bad("missing arrays");
  if (s.rank_mb[0] != 0) bad("rank_mb[0] = " + num(s.rank_mb[0]) + ", expected 0");
  for (int h = 0; h < H; ++h)
    if (s.rank_mb[h + 1] < s.rank_mb[h]) bad("rank_mb decreases at pipeline " + num(h));
  if (s.rank_mb[H] != M)
    bad("rank_mb[pipelines] = " + num(s.rank_mb[H]) + " but there are " + num(M) + " micro-batches");
  if (s.ring_grp[0] != 0) bad("ring_grp[0] must be 0");
  for (int64_t k = 0; k < R; ++k)
    if (s.ring_grp[k + 1] <= s.ring_grp[k]) bad("ring " + num(k) + " has an empty group");
  if (s.ring_grp[R] != s.num_grp_ranks)
    bad("ring_grp[rings] = " + num(s.ring_grp[R]) + " but grp_ranks has " + num(s.num_grp_ranks) + " entries");
  for (int64_t k = 0; k < s.num_grp_ranks; ++k)
    if (s.grp_ranks[k] < 0 || s.grp_ranks[k] >= H)
      bad("grp_ranks[" + num(k) + "] = " + num(s.grp_ranks[k]) + " outside [0, " + num(H) + ")");
  for (int h = 0; h < H; ++h) {
    int64_t prev = -1;
    for (int64_t m = s.rank_mb[h]; m < s.rank_mb[h + 1]; ++m) {
      if (s.mb_ring[m] < -1 || s.mb_ring[m] >= R)
        bad("micro-batch " + num(m) + " has ring id " + num(s.mb_ring[m]) + " outside [-1, " + num(R) + ")");
      // A slot is below the number of micro-batches: every slot before a micro-batch's holds one
      // of the micro-batches it waits for (bounds what a corrupt plan can make the replay walk).
      if (v.mb_slot[m] <= prev || v.mb_slot[m] >= std::max<int64_t>(M, 1))
        bad("pipeline " + num(h) + ": micro-batch " + num(m) + " has slot " + num(v.mb_slot[m]) +
            " after slot " + num(prev) + " (slots must increase along a pipeline and stay below " +
            num(std::max<int64_t>(M, 1)) + ")");
      prev = v.mb_slot[m];
    }
  }
  // Every ring: held once by each member pipeline, at one slot.
  std::vector<int64_t> seen_slot(R, -1), count(R, 0);
  std::vector<int64_t> mark(H, -1);
  std::vector<int64_t> first(R, -1), next(M, -1);
  for (int h = 0; h < H; ++h)
    for (int64_t m = s.rank_mb[h]; m < s.rank_mb[h + 1]; ++m) {
      const int64_t id = s.mb_ring[m];
      if (id < 0) continue;
      if (count[id]++ == 0) seen_slot[id] = v.mb_slot[m];
      else if (seen_slot[id] != v.mb_slot[m])
        bad("ring " + num(id) + " sits at slot " + num(seen_slot[id]) + " on one member and slot " +
            num(v.mb_slot[m]) + " on pipeline " + num(h) +
            " (a ring micro-batch must sit at the same slot on every member pipeline)");
      next[m] = first[id];
      first[id] = m;
    }
  std::vector<int> rank_of(M);
  for (int h = 0; h < H; ++h)
    for (int64_t m = s.rank_mb[h]; m < s.rank_mb[h + 1]; ++m) rank_of[m] = h;
  for (int64_t id = 0; id < R; ++id) {
    const int64_t g0 = s.ring_grp[id], g1 = s.ring_grp[id + 1];
    if (count[id] != g1 - g0)
      bad("ring " + num(id) + " has " + num(count[id]) + " micro-batches for a group of " + num(g1 - g0));
    for (int64_t g = g0; g < g1; ++g) mark[s.grp_ranks[g]] = id;
    for (int64_t q = first[id]; q >= 0; q = next[q]) {
      if (mark[rank_of[q]] != id)
        bad("pipeline " + num(rank_of[q]) + " runs ring " + num(id) +
            " but is not in its group (or holds it twice)");
      mark[rank_of[q]] = -1;
    }
  }
}

// One stage of one pipeline walking its 1F1B order (pipeline.h) over its non-empty slots.
struct Actor {
  int h = 0, p = 0;
  int64_t fi = 0, bi = 0;  // next forward / backward micro-batch (absolute index)
  int64_t w = 0, S = 0;    // warm-up forwards, slots
  double t = 0;            // free from
  bool queued = false;
  bool waiting = false;  // blocked on the neighbouring stage (woken by its completion)
  bool wait_bwd = false;   // ... of the operation (wait_m, wait_bwd) there
  int64_t wait_m = -1;
  bool in_ring = false;  // arrived at a ring operation (woken by the ring's completion only)
};

// Position of slot k's forward / backward in the 1F1B order of S slots and w warm-up forwards.
inline int64_t posF(int64_t k, int64_t w) { return k < w ? k : w + 2 * (k - w); }
inline int64_t posB(int64_t k, int64_t w, int64_t S) { return k < S - w ? w + 2 * k + 1 : S + k; }

constexpr double kNotDone = -1.0;

}  // namespace

PipelineView pipelineOf(const Plan& p) {
  if (!p.pipelined())
    throw std::invalid_argument("pipeline replay: the plan has no pipeline slots (made with pp = 1 and a "
                                "strategy other than pp-balance / pp-lockstep)");
  PipelineView v;
  v.sched = scheduleOf(p);
  v.stages = p.pp;
  if (static_cast<int64_t>(p.mb_slot.size()) != p.numMicroBatches())
    bad("mb_slot has " + num(p.mb_slot.size()) + " entries for " + num(p.numMicroBatches()) + " micro-batches");
  v.mb_slot = p.mb_slot.data();
  return v;
}

std::vector<int64_t> oneFOneB(int64_t slots, int stages, int stage) {
  if (slots < 0 || stages < 1 || stage < 0 || stage >= stages)
    throw std::invalid_argument("1F1B: need slots >= 0 and 0 <= stage < stages, got slots " + num(slots) +
                                ", stage " + num(stage) + " of " + num(stages));
  const int64_t w = std::min<int64_t>(stages - 1 - stage, slots);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(2 * slots));
  for (int64_t k = 0; k < w; ++k) out.push_back(2 * k);
  for (int64_t i = 0; i < slots - w; ++i) {
    out.push_back(2 * (w + i));
    out.push_back(2 * i + 1);
  }
  for (int64_t k = slots - w; k < slots; ++k) out.push_back(2 * k + 1);
  return out;
}

struct ReplayScratch::Buffers {
  std::vector<int> rank_of;
  std::vector<Actor> actors;
  std::vector<int32_t> arrived;
  std::vector<double> tmax, dmax;
  std::vector<int64_t> head, nxt;
  std::vector<Actor*> todo;
};

ReplayScratch::ReplayScratch() : buf(new Buffers) {}
ReplayScratch::~ReplayScratch() = default;

PipelineReplay replayPipeline(const PipelineView& v, const double* fwd, const double* bwd,
                              const double* p2p, int64_t num_durations) {
  PipelineReplay out;
  ReplayScratch scratch;
  replayPipelineInto(v, fwd, bwd, p2p, num_durations, out, scratch, true);
  return out;
}

void replayPipelineInto(const PipelineView& v, const double* fwd, const double* bwd, const double* p2p,
                        int64_t num_durations, PipelineReplay& out, ReplayScratch& scratch, bool checked) {
  ReplayScratch::Buffers& ws = *scratch.buf;
  const ScheduleView& s = v.sched;
  const int H = s.world_size, P = v.stages;
  const int64_t M = s.num_mb, R = s.num_rings;
  if (checked) {
    validate(v);
    if (num_durations != M)
      bad("got durations for " + num(num_durations) + " micro-batches, the schedule has " + num(M));
    for (int64_t k = 0; k < M * P; ++k)
      if (!(fwd[k] >= 0) || !std::isfinite(fwd[k]) || !(bwd[k] >= 0) || !std::isfinite(bwd[k]))
        bad("micro-batch " + num(k / P) + " at stage " + num(k % P) + " has duration fwd " +
            std::to_string(fwd[k]) + " / bwd " + std::to_string(bwd[k]) + " (must be finite and >= 0)");
    for (int64_t m = 0; m < M; ++m)
      if (!(p2p[m] >= 0) || !std::isfinite(p2p[m]))
        bad("micro-batch " + num(m) + " has transfer time " + std::to_string(p2p[m]));
  } else if (num_durations != M) {
    bad("got durations for " + num(num_durations) + " micro-batches, the schedule has " + num(M));
  }
  out.pipelines = H;
  out.stages = P;
  out.fwd_start.assign(M * P, 0.0);
  out.fwd_end.assign(M * P, kNotDone);
  out.bwd_start.assign(M * P, 0.0);
  out.bwd_end.assign(M * P, kNotDone);
  out.pipe_finish.assign(H, 0.0);
  out.stage_busy.assign(static_cast<size_t>(H) * P, 0.0);
  std::vector<int>& rank_of = ws.rank_of;
  rank_of.resize(M);
  for (int h = 0; h < H; ++h)
    for (int64_t m = s.rank_mb[h]; m < s.rank_mb[h + 1]; ++m) rank_of[m] = h;
  std::vector<Actor>& actors = ws.actors;
  actors.assign(static_cast<size_t>(H) * P, Actor());
  for (int h = 0; h < H; ++h) {
    const int64_t n = s.rank_mb[h + 1] - s.rank_mb[h];
    const int64_t S = n ? v.mb_slot[s.rank_mb[h + 1] - 1] + 1 : 0;
    for (int p = 0; p < P; ++p) {
      Actor& a = actors[static_cast<size_t>(h) * P + p];
      a.h = h;
      a.p = p;
      a.fi = a.bi = s.rank_mb[h];
      a.S = S;
      a.w = std::min<int64_t>(P - 1 - p, S);
    }
  }
  // Ring synchronisation per (ring, stage, direction): arrivals, the latest ready time, the
  // largest duration and the arrived micro-batches (linked through `nxt`, per direction/stage).
  const size_t K = static_cast<size_t>(R) * P * 2;
  std::vector<int32_t>& arrived = ws.arrived;
  std::vector<double>& tmax = ws.tmax;
  std::vector<double>& dmax = ws.dmax;
  std::vector<int64_t>& head = ws.head;
  std::vector<int64_t>& nxt = ws.nxt;
  arrived.assign(K, 0);
  tmax.assign(K, 0.0);
  dmax.assign(K, 0.0);
  head.assign(K, -1);
  nxt.resize(static_cast<size_t>(M) * P * 2);  // written when an operation arrives at its ring
  std::vector<Actor*>& todo = ws.todo;
  todo.clear();
  todo.reserve(actors.size());
  for (size_t i = actors.size(); i-- > 0;) {
    actors[i].queued = true;
    todo.push_back(&actors[i]);
  }
  // Wakes stage p of pipeline h if it waits for operation (m, is_bwd) of its neighbour.
  auto wake = [&](int h, int p, int64_t m, bool is_bwd) {
    if (p < 0 || p >= P) return;
    Actor& a = actors[static_cast<size_t>(h) * P + p];
    if (a.waiting && !a.queued && a.wait_m == m && a.wait_bwd == is_bwd) {
      a.waiting = false;
      a.queued = true;
      todo.push_back(&a);
    }
  };
  // Records operation (m, p, dir) on [st, en) for its actor and wakes the neighbours waiting on it.
  auto complete = [&](Actor& a, int64_t m, bool is_bwd, double st, double en) {
    const size_t k = static_cast<size_t>(m) * P + a.p;
    if (is_bwd) {
      out.bwd_start[k] = st;
      out.bwd_end[k] = en;
      ++a.bi;
    } else {
      out.fwd_start[k] = st;
      out.fwd_end[k] = en;
      ++a.fi;
    }
    a.t = en;
    out.stage_busy[static_cast<size_t>(a.h) * P + a.p] += en - st;
    wake(a.h, is_bwd ? a.p - 1 : a.p + 1, m, is_bwd);
  };
  while (!todo.empty()) {
    Actor& a = *todo.back();
    todo.pop_back();
    a.queued = false;
    const int64_t end = s.rank_mb[a.h + 1];
    while (a.fi < end || a.bi < end) {
      // The next operation: whichever of the next forward / backward comes first in 1F1B order.
      bool is_bwd;
      if (a.fi >= end) is_bwd = true;
      else if (a.bi >= end) is_bwd = false;
      else is_bwd = posB(v.mb_slot[a.bi], a.w, a.S) < posF(v.mb_slot[a.fi], a.w);
      const int64_t m = is_bwd ? a.bi : a.fi;
      const size_t k = static_cast<size_t>(m) * P + a.p;
      double ready = a.t;
      if (!is_bwd && a.p > 0) {
        const double e = out.fwd_end[k - 1];
        if (e == kNotDone) {  // waits for the previous stage (woken by that forward's completion)
          a.wait_m = m;
          a.wait_bwd = false;
          break;
        }
        ready = std::max(ready, e + p2p[m]);
      } else if (is_bwd && a.p < P - 1) {
        const double e = out.bwd_end[k + 1];
        if (e == kNotDone) {
          a.wait_m = m;
          a.wait_bwd = true;
          break;
        }
        ready = std::max(ready, e + p2p[m]);
      }
      const double dur = is_bwd ? bwd[k] : fwd[k];
      const int64_t id = s.mb_ring[m];
      if (id < 0) {
        complete(a, m, is_bwd, ready, ready + dur);
        continue;
      }
      const size_t key = (static_cast<size_t>(id) * P + a.p) * 2 + (is_bwd ? 1 : 0);
      if (arrived[key] == 0) {
        tmax[key] = ready;
        dmax[key] = dur;
      } else {
        tmax[key] = std::max(tmax[key], ready);
        dmax[key] = std::max(dmax[key], dur);
      }
      const size_t op = k * 2 + (is_bwd ? 1 : 0);
      nxt[op] = head[key];
      head[key] = static_cast<int64_t>(m);
      const int64_t size = s.ring_grp[id + 1] - s.ring_grp[id];
      if (++arrived[key] < size) {
        a.in_ring = true;  // the last member to arrive completes the ring for everyone
        break;
      }
      const double st = tmax[key], en = st + dmax[key];
      for (int64_t q = head[key]; q >= 0;) {
        const size_t qop = (static_cast<size_t>(q) * P + a.p) * 2 + (is_bwd ? 1 : 0);
        const int64_t after = nxt[qop];
        Actor& b = actors[static_cast<size_t>(rank_of[q]) * P + a.p];
        b.in_ring = false;
        complete(b, q, is_bwd, st, en);
        if (&b != &a && !b.queued) {
          b.queued = true;
          todo.push_back(&b);
        }
        q = after;
      }
    }
    a.waiting = (a.fi < end || a.bi < end) && !a.in_ring;
  }
  // Anything left is a deadlock: name a few blocked stages and what they wait for.
  std::vector<const Actor*> blocked;
  for (const Actor& a : actors)
    if (a.fi < s.rank_mb[a.h + 1] || a.bi < s.rank_mb[a.h + 1]) blocked.push_back(&a);
  if (!blocked.empty()) {
    std::ostringstream os;
    os << "the schedule deadlocks (" << blocked.size() << " stages blocked):";
    for (size_t i = 0; i < blocked.size() && i < 4; ++i) {
      const Actor& a = *blocked[i];
      const int64_t end = s.rank_mb[a.h + 1];
      const bool is_bwd = a.fi >= end || (a.bi < end && posB(v.mb_slot[a.bi], a.w, a.S) < posF(v.mb_slot[a.fi], a.w));
      const int64_t m = is_bwd ? a.bi : a.fi;
      os << " pipeline " << a.h << " stage " << a.p << " at " << (is_bwd ? "backward" : "forward")
         << " of slot " << v.mb_slot[m];
      if (s.mb_ring[m] >= 0) os << " (ring " << s.mb_ring[m] << ")";
      os << ";";
    }
    os << " ring micro-batches must sit at the same slot on every member pipeline";
    bad(os.str());
  }
  double step = 0, busy = 0;
  for (int h = 0; h < H; ++h) {
    double f = 0;
    for (int p = 0; p < P; ++p) {
      f = std::max(f, actors[static_cast<size_t>(h) * P + p].t);
      busy += out.stage_busy[static_cast<size_t>(h) * P + p];
    }
    out.pipe_finish[h] = f;
    step = std::max(step, f);
  }
  out.step_time = step;
  out.bubble = step > 0 ? std::max(0.0, 1.0 - busy / (static_cast<double>(H) * P * step)) : 0.0;
}

PipelineReplay replayPipeline(const Plan& p) {
  const PipelineView v = pipelineOf(p);
  const int P = p.pp;
  const int64_t M = p.numMicroBatches();
  if (static_cast<int64_t>(p.mb_p2p.size()) != M)
    bad("mb_p2p has " + num(p.mb_p2p.size()) + " entries for " + num(M) + " micro-batches");
  std::vector<double> f(static_cast<size_t>(M) * P), b(static_cast<size_t>(M) * P);
  for (int64_t m = 0; m < M; ++m)
    for (int q = 0; q < P; ++q) {
      f[m * P + q] = p.pp_fwd_share * p.mb_cost[m];
      b[m * P + q] = p.mb_cost[m] - f[m * P + q];
    }
  return replayPipeline(v, f.data(), b.data(), p.mb_p2p.data(), M);
}
namespace detail {

void checkPipelineStructure(const Plan& p) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("plan: " + m); };
  const int64_t M = p.numMicroBatches();
  if (p.pp < 1) fail("pp = " + num(p.pp) + " (must be >= 1)");
  if (!(p.pp_fwd_share > 0 && p.pp_fwd_share < 1)) fail("pp_fwd_share outside (0, 1)");
  if (!p.mb_slot.empty() && static_cast<int64_t>(p.mb_slot.size()) != M)
    fail("mb_slot has " + num(p.mb_slot.size()) + " entries for " + num(M) + " micro-batches");
  if (p.mb_p2p.size() != p.mb_slot.size()) fail("mb_p2p and mb_slot disagree in length");
  if (p.pp > 1 && M > 0 && p.mb_slot.empty()) fail("pp = " + num(p.pp) + " but no micro-batch has a slot");
  for (double x : p.mb_p2p)
    if (!(x >= 0) || !std::isfinite(x)) fail("a transfer time is negative or not finite");
  if (!p.pipelined()) return;
  PipelineView v;
  v.sched = scheduleOf(p);
  v.stages = p.pp;
  v.mb_slot = p.mb_slot.data();
  try {
    validate(v);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale
