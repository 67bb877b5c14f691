// Python bindings of the planner's step model (csrc/planner/replay.h, pipeline.h): the flat replay,
// the FSDP2 lockstep slots and their expert-parallel form with its replay, the 1F1B order and the
// pipeline replay. Each is bound once and reads one schedule view, `Schedule`: a plan's own arrays
// (a Plan converts implicitly, without copies; its costs are the default durations) or arrays given
// from Python (a schedule built outside the planner, e.g. the simulator's).
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "planner/pipeline.h"
#include "planner/planner.h"
#include "planner/replay.h"

namespace py = pybind11;

namespace bytescale {

namespace {
using planner::LockstepSlots;
using planner::PipelineReplay;
using planner::PipelineView;
using planner::Plan;
using planner::ReplayResult;
using planner::ScheduleView;

// One schedule: the plan's arrays (plan set) or its own copies of arrays given from Python.
struct Schedule {
  std::shared_ptr<const Plan> plan;
  int world_size = 0, stages = 1;
  bool has_slots = false;
  std::vector<int64_t> rank_mb, mb_ring, ring_grp, mb_slot;
  std::vector<int32_t> grp_ranks;

  ScheduleView view() const {
    if (plan) return planner::scheduleOf(*plan);
    ScheduleView v;
    v.world_size = world_size;
    v.rank_mb = rank_mb.data();
    v.num_mb = static_cast<int64_t>(mb_ring.size());
    v.mb_ring = mb_ring.data();
    v.num_rings = static_cast<int64_t>(ring_grp.size()) - 1;
    v.ring_grp = ring_grp.data();
    v.grp_ranks = grp_ranks.data();
    v.num_grp_ranks = static_cast<int64_t>(grp_ranks.size());
    return v;
  }
  PipelineView pipeline() const {
    if (plan) return planner::pipelineOf(*plan);  // throws for a plan without slots
    if (!has_slots)
      throw py::value_error("pipeline replay: the schedule has no pipeline slots (build it with mb_slot)");
    PipelineView p;
    p.sched = view();
    p.stages = stages;
    p.mb_slot = mb_slot.data();
    return p;
  }
  int64_t numMicroBatches() const { return plan ? plan->numMicroBatches() : static_cast<int64_t>(mb_ring.size()); }
};

template <typename T>
std::vector<T> copy1d(const Arr<T>& a, const char* name) {
  check1d(a, name);
  return std::vector<T>(a.data(), a.data() + a.size());
}

std::shared_ptr<Schedule> fromArrays(int world_size, const Arr<int64_t>& rank_mb, const Arr<int64_t>& mb_ring,
                                     const Arr<int64_t>& ring_grp, const Arr<int32_t>& grp_ranks,
                                     const py::object& mb_slot, int stages) {
  if (world_size < 1) throw py::value_error("world_size must be >= 1, got " + std::to_string(world_size));
  if (stages < 1) throw py::value_error("stages must be >= 1, got " + std::to_string(stages));
  auto s = std::make_shared<Schedule>();
  s->world_size = world_size;
  s->stages = stages;
  s->rank_mb = copy1d(rank_mb, "rank_mb");
  s->mb_ring = copy1d(mb_ring, "mb_ring");
  s->ring_grp = copy1d(ring_grp, "ring_grp");
  s->grp_ranks = copy1d(grp_ranks, "grp_ranks");
  if (static_cast<int64_t>(s->rank_mb.size()) != world_size + 1)
    throw py::value_error("rank_mb needs world_size + 1 entries, got " + std::to_string(s->rank_mb.size()));
  if (s->ring_grp.empty()) throw py::value_error("ring_grp needs rings + 1 entries (at least [0])");
  if (!mb_slot.is_none()) {
    s->mb_slot = copy1d(py::cast<Arr<int64_t>>(mb_slot), "mb_slot");
    s->has_slots = true;
    if (s->mb_slot.size() != s->mb_ring.size()) throw py::value_error("mb_slot and mb_ring disagree in length");
  } else if (stages > 1) {
    throw py::value_error("a schedule of " + std::to_string(stages) + " stages needs mb_slot");
  }
  planner::checkSchedule(s->view());
  return s;
}

std::shared_ptr<Schedule> fromPlan(const std::shared_ptr<Plan>& p) {
  auto s = std::make_shared<Schedule>();
  s->plan = p;
  s->world_size = p->world_size;
  s->stages = p->pp;
  s->has_slots = p->pipelined();
  return s;
}

// A float64 argument of one entry per micro-batch (sizes are checked by the step model), or the
// plan's costs when None.
struct Doubles {
  Arr<double> keep;
  const double* data = nullptr;
  int64_t size = 0;
};

Doubles doubles(const Schedule& s, const py::object& obj, const char* name) {
  Doubles d;
  if (obj.is_none()) {
    if (!s.plan)
      throw py::value_error(std::string(name) + ": a schedule built from arrays has no costs of its own; give " +
                            name);
    d.data = s.plan->mb_cost.data();
    d.size = static_cast<int64_t>(s.plan->mb_cost.size());
    return d;
  }
  d.keep = py::cast<Arr<double>>(obj);
  check1d(d.keep, name);
  d.data = d.keep.data();
  d.size = d.keep.size();
  return d;
}

py::array slotsArray(const LockstepSlots& s) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(s.world_size), static_cast<py::ssize_t>(s.num_slots)});
  if (!s.mb.empty()) std::memcpy(out.mutable_data(), s.mb.data(), s.mb.size() * sizeof(int64_t));
  return out;
}

LockstepSlots slotsOf(const Arr<int64_t>& a) {
  if (a.ndim() != 2) throw py::value_error("slots must be 2-D [units, slots], got " + std::to_string(a.ndim()) + " dimensions");
  LockstepSlots s;
  s.world_size = static_cast<int>(a.shape(0));
  s.num_slots = a.shape(1);
  s.mb.assign(a.data(), a.data() + a.size());
  return s;
}

std::shared_ptr<PipelineReplay> pipelineReplay(const Schedule& s, const py::object& fwd, const py::object& bwd,
                                               const py::object& p2p) {
  if (fwd.is_none() && bwd.is_none() && p2p.is_none()) {
    if (!s.plan) throw py::value_error("pipeline_replay: a schedule built from arrays needs fwd, bwd and p2p");
    py::gil_scoped_release nogil;
    return std::make_shared<PipelineReplay>(planner::replayPipeline(*s.plan));
  }
  if (fwd.is_none() || bwd.is_none() || p2p.is_none())
    throw py::value_error("pipeline_replay: give fwd, bwd and p2p together (or none of them)");
  const PipelineView v = s.pipeline();
  Arr<double> f = py::cast<Arr<double>>(fwd), b = py::cast<Arr<double>>(bwd), x = py::cast<Arr<double>>(p2p);
  const int64_t M = s.numMicroBatches(), P = v.stages;
  if (f.size() != M * P || b.size() != M * P || x.size() != M)
    throw py::value_error("pipeline_replay: fwd and bwd need micro-batches x stages = " + std::to_string(M * P) +
                          " entries, p2p " + std::to_string(M) + "; got " + std::to_string(f.size()) + ", " +
                          std::to_string(b.size()) + ", " + std::to_string(x.size()));
  py::gil_scoped_release nogil;
  return std::make_shared<PipelineReplay>(planner::replayPipeline(v, f.data(), b.data(), x.data(), M));
}
}  // namespace

void bind_step_model(py::module_& m) {
  py::class_<Schedule, std::shared_ptr<Schedule>>(
      m, "Schedule",
      "One step's schedule as the step model reads it (csrc/planner/replay.h ScheduleView): rank r's "
      "micro-batches are [rank_mb[r], rank_mb[r+1]) in order, mb_ring the ring of each (-1: local), ring k's "
      "group grp_ranks[ring_grp[k] .. ring_grp[k+1]); pipelined: mb_slot, the 1F1B slot of each, over "
      "`stages` stages. Schedule(plan) is the plan's own (no copy; a Plan converts implicitly); "
      "Schedule(world_size, rank_mb, mb_ring, ring_grp, grp_ranks, mb_slot=None, stages=1) copies and checks "
      "arrays built elsewhere (ValueError naming the first problem).")
      .def(py::init(&fromPlan), py::arg("plan"))
      .def(py::init(&fromArrays), py::arg("world_size"), py::arg("rank_mb"), py::arg("mb_ring"),
           py::arg("ring_grp"), py::arg("grp_ranks"), py::arg("mb_slot") = py::none(), py::arg("stages") = 1)
      .def_readonly("world_size", &Schedule::world_size)
      .def_readonly("stages", &Schedule::stages)
      .def_readonly("pipelined", &Schedule::has_slots)
      .def_property_readonly("num_micro_batches", &Schedule::numMicroBatches)
      .def_property_readonly("plan", [](const Schedule& s) { return std::const_pointer_cast<Plan>(s.plan); })
#define BYTESCALE_VIEW(name)                                                                            \
  .def_property_readonly(#name, [](const std::shared_ptr<Schedule>& s) {                                \
    return s->plan ? view(std::const_pointer_cast<Plan>(s->plan), s->plan->name) : view(s, s->name);   \
  })
      BYTESCALE_VIEW(rank_mb) BYTESCALE_VIEW(mb_ring) BYTESCALE_VIEW(ring_grp) BYTESCALE_VIEW(grp_ranks)
      BYTESCALE_VIEW(mb_slot)
#undef BYTESCALE_VIEW
      ;
  py::implicitly_convertible<Plan, Schedule>();

  py::class_<ReplayResult, std::shared_ptr<ReplayResult>>(
      m, "ReplayResult", "A schedule replayed in the runtime's model (csrc/planner/replay.h).")
      .def_readonly("step_time", &ReplayResult::step_time)
#define BYTESCALE_VIEW(name)                                                   \
  .def_property_readonly(#name, [](const std::shared_ptr<ReplayResult>& r) { return view(r, r->name); })
      BYTESCALE_VIEW(mb_start) BYTESCALE_VIEW(mb_end) BYTESCALE_VIEW(rank_finish)
      BYTESCALE_VIEW(rank_busy) BYTESCALE_VIEW(rank_idle)
#undef BYTESCALE_VIEW
      ;

  m.def(
      "replay",
      [](const Schedule& s, const py::object& durations) {
        Doubles d = doubles(s, durations, "durations");
        const ScheduleView v = s.view();
        py::gil_scoped_release nogil;
        return std::make_shared<ReplayResult>(planner::replay(v, d.data, d.size));
      },
      py::arg("schedule"), py::arg("durations") = py::none(),
      "Replays a schedule (a Plan or a Schedule): each rank runs its micro-batches in order, a ring "
      "micro-batch starts when all its members are free and ends at start + the largest duration among them. "
      "durations: per micro-batch (indexed like plan.mb_cost), default the plan's mb_cost. ValueError on a "
      "deadlocking order or malformed input.");
  m.def(
      "lockstep",
      [](const Schedule& s) {
        const ScheduleView v = s.view();
        LockstepSlots out;
        {
          py::gil_scoped_release nogil;
          out = planner::lockstepSlots(v);
        }
        return slotsArray(out);
      },
      py::arg("schedule"),
      "FSDP2 lockstep slots: int64 [world_size, slots], the micro-batch index each rank runs in each slot, -1 "
      "for an empty (padding) slot. Ring members meet in the same slot; locals fill the free slots in order.");
  m.def(
      "group_lockstep",
      [](const Schedule& s, int group, const py::object& cost) {
        Doubles c = doubles(s, cost, "cost");
        const ScheduleView v = s.view();
        LockstepSlots out;
        {
          py::gil_scoped_release nogil;
          out = planner::groupLockstep(v, group, c.data, c.size);
        }
        return slotsArray(out);
      },
      py::arg("schedule"), py::arg("group"), py::arg("cost") = py::none(),
      "Expert-parallel lockstep slots (blocks of `group` consecutive units): lockstep() with each unit's "
      "local micro-batches in its free slots costliest first (cost: per micro-batch, default the plan's "
      "mb_cost). ValueError when group does not divide the units.");
  m.def(
      "group_slots",
      [](const Arr<int64_t>& slots, int group) {
        const std::vector<int64_t> c = planner::groupSlotCounts(slotsOf(slots), group);
        py::array_t<int64_t> out(static_cast<py::ssize_t>(c.size()));
        if (!c.empty()) std::memcpy(out.mutable_data(), c.data(), c.size() * sizeof(int64_t));
        return out;
      },
      py::arg("slots"), py::arg("group"),
      "Per unit of lockstep slots [units, slots]: the slots its block of `group` units runs (the block's "
      "last used slot + 1); group 0: every slot.");
  m.def(
      "ep_replay",
      [](const Schedule& s, int group, const py::object& durations, const py::object& cost) {
        Doubles c = doubles(s, cost, "cost"), d = doubles(s, durations, "durations");
        const ScheduleView v = s.view();
        py::gil_scoped_release nogil;
        const LockstepSlots slots = planner::groupLockstep(v, group, c.data, c.size);
        return std::make_shared<ReplayResult>(planner::epSlotReplay(slots, group, v, d.data, d.size));
      },
      py::arg("schedule"), py::arg("group"), py::arg("durations") = py::none(), py::arg("cost") = py::none(),
      "The schedule replayed as expert parallelism runs it: group_lockstep(schedule, group, cost), EP blocks "
      "advancing slot by slot together, a ring joining its members' blocks, each slot as long as its slowest "
      "micro-batch (durations, default the plan's mb_cost). rank_finish is each unit's end.");

  py::class_<PipelineReplay, std::shared_ptr<PipelineReplay>>(
      m, "PipelineReplay", "A pipelined schedule replayed under 1F1B (csrc/planner/pipeline.h).")
      .def_readonly("pipelines", &PipelineReplay::pipelines)
      .def_readonly("stages", &PipelineReplay::stages)
      .def_readonly("step_time", &PipelineReplay::step_time)
      .def_readonly("bubble", &PipelineReplay::bubble)
#define BYTESCALE_VIEW(name)                                                   \
  .def_property_readonly(#name, [](const std::shared_ptr<PipelineReplay>& r) { return view(r, r->name); })
      BYTESCALE_VIEW(fwd_start) BYTESCALE_VIEW(fwd_end) BYTESCALE_VIEW(bwd_start) BYTESCALE_VIEW(bwd_end)
      BYTESCALE_VIEW(pipe_finish) BYTESCALE_VIEW(stage_busy)
#undef BYTESCALE_VIEW
      ;
  m.def("pipeline_replay", &pipelineReplay, py::arg("schedule"), py::arg("fwd") = py::none(),
        py::arg("bwd") = py::none(), py::arg("p2p") = py::none(),
        "Replays a pipelined schedule (a Plan or a Schedule with mb_slot) under 1F1B: a plan's own costs by "
        "default, or fwd / bwd (micro-batches x stages, row-major) and p2p (per micro-batch) seconds. "
        "ValueError on malformed input.");
  m.def("one_f_one_b", &planner::oneFOneB, py::arg("slots"), py::arg("stages"), py::arg("stage"),
        "The 1F1B operations of one stage: 2k = forward of slot k, 2k + 1 = its backward.");
}

}  // namespace bytescale
