// Python bindings of the HDP planner. Plan arrays are exposed as read-only numpy views whose base
// is the Plan itself: no copies of large arrays.
#include "bindings/bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>

#include "planner/feasibility.h"
#include "planner/pipeline.h"
#include "planner/offload_rule.h"
#include "planner/planner.h"
#include "planner/reference.h"
#include "planner/replay.h"

namespace py = pybind11;

namespace bytescale {

namespace {
using planner::CostModel;
using planner::LockstepSlots;
using planner::PipelineReplay;
using planner::Plan;
using planner::PlanOptions;
using planner::ReplayResult;

template <typename T, typename Owner>
py::array view(const std::shared_ptr<Owner>& owner, const std::vector<T>& v) {
  py::array a(py::dtype::of<T>(), {static_cast<py::ssize_t>(v.size())}, {sizeof(T)}, v.data(),
              py::cast(owner));
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

// One rank's micro-batches as Python objects: [(segments, group, offload_ratio, cost), ...] with
// segments = [(seq, ring_size, ring_pos, tokens), ...].
py::list rankMicroBatches(const Plan& p, int rank) {
  if (rank < 0 || rank >= p.world_size)
    throw py::index_error("rank " + std::to_string(rank) + " outside [0, " +
                          std::to_string(p.world_size) + ")");
  py::list out;
  for (int64_t m = p.rank_mb[rank]; m < p.rank_mb[rank + 1]; ++m) {
    py::list segs;
    for (int64_t k = p.mb_seg[m]; k < p.mb_seg[m + 1]; ++k)
      segs.append(py::make_tuple(p.seg_seq[k], p.seg_ring_size[k], p.seg_ring_pos[k], p.seg_tokens[k]));
    const int64_t id = p.mb_ring[m];
    const int64_t g0 = id >= 0 ? p.ring_grp[id] : 0, g1 = id >= 0 ? p.ring_grp[id + 1] : 0;
    py::tuple group(g1 - g0);
    for (int64_t g = g0; g < g1; ++g) group[g - g0] = py::int_(p.grp_ranks[g]);
    out.append(py::make_tuple(segs, group, p.mb_offload[m], p.mb_cost[m]));
  }
  return out;
}

// A 1-D array argument as a pointer and length (int64/int32/float64, C-contiguous, cast if needed).
template <typename T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
void check1d(const Arr<T>& a, const char* name) {
  if (a.ndim() != 1)
    throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) + " dimensions");
}

std::shared_ptr<ReplayResult> replayPlan(const Plan& p, const py::object& durations) {
  if (durations.is_none()) {
    py::gil_scoped_release nogil;
    return std::make_shared<ReplayResult>(planner::replay(p));
  }
  Arr<double> d = py::cast<Arr<double>>(durations);
  check1d(d, "durations");
  if (d.size() != p.numMicroBatches())
    throw py::value_error("durations has " + std::to_string(d.size()) + " entries for " +
                          std::to_string(p.numMicroBatches()) + " micro-batches");
  const double* dp = d.data();
  const int64_t n = d.size();
  py::gil_scoped_release nogil;
  return std::make_shared<ReplayResult>(planner::replay(planner::scheduleOf(p), dp, n));
}

// fwd / bwd: None (with the plan: its own costs) or float64 of num_mb x stages entries.
std::shared_ptr<PipelineReplay> pipelineReplayPlan(const Plan& p, const py::object& fwd, const py::object& bwd,
                                                   const py::object& p2p) {
  if (fwd.is_none() && bwd.is_none() && p2p.is_none()) {
    py::gil_scoped_release nogil;
    return std::make_shared<PipelineReplay>(planner::replayPipeline(p));
  }
  if (fwd.is_none() || bwd.is_none() || p2p.is_none())
    throw py::value_error("pipeline_replay: give fwd, bwd and p2p together (or none of them)");
  const planner::PipelineView v = planner::pipelineOf(p);
  Arr<double> f = py::cast<Arr<double>>(fwd), b = py::cast<Arr<double>>(bwd), x = py::cast<Arr<double>>(p2p);
  const int64_t M = p.numMicroBatches(), P = p.pp;
  if (f.size() != M * P || b.size() != M * P || x.size() != M)
    throw py::value_error("pipeline_replay: fwd and bwd need micro-batches x stages = " + std::to_string(M * P) +
                          " entries, p2p " + std::to_string(M) + "; got " + std::to_string(f.size()) + ", " +
                          std::to_string(b.size()) + ", " + std::to_string(x.size()));
  py::gil_scoped_release nogil;
  return std::make_shared<PipelineReplay>(planner::replayPipeline(v, f.data(), b.data(), x.data(), M));
}

py::array lockstepArray(const LockstepSlots& s) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(s.world_size), static_cast<py::ssize_t>(s.num_slots)});
  if (!s.mb.empty()) std::memcpy(out.mutable_data(), s.mb.data(), s.mb.size() * sizeof(int64_t));
  return out;
}
}  // namespace

void bind_planner(py::module_& m) {
  py::class_<CostModel>(m, "CostModel", "Per-layer cost model T(s)=a1 s^2+b1 s+g, Act(s)=a2 s+b2.")
      .def(py::init<>())
      .def_readwrite("a1", &CostModel::a1)
      .def_readwrite("b1", &CostModel::b1)
      .def_readwrite("g", &CostModel::g)
      .def_readwrite("a2", &CostModel::a2)
      .def_readwrite("b2", &CostModel::b2)
      .def_readwrite("layers", &CostModel::layers)
      .def_readwrite("bw_d2h", &CostModel::bw_d2h)
      .def_readwrite("bw_h2d", &CostModel::bw_h2d)
      .def_readwrite("ring_bw", &CostModel::ring_bw)
      .def_readwrite("ring_latency", &CostModel::ring_latency)
      .def_readwrite("kv_bytes_per_token", &CostModel::kv_bytes_per_token)
      .def("layer_time", &CostModel::layerTime)
      .def("act", &CostModel::act)
      .def("seq_time", &CostModel::seqTime)
      .def("sharded_time", &CostModel::shardedTime, py::arg("s"), py::arg("ranks"))
      .def("validate", &CostModel::validate)
      .def("to_json", &CostModel::toJson)
      .def_static("from_json", &CostModel::fromJson, py::arg("text"));

  m.def(
      "solve_offload",
      [](const CostModel& cm, int64_t s, int64_t capacity) {
        auto c = planner::solveOffload(cm, s, capacity);
        return py::make_tuple(c.ranks, c.ratio);
      },
      py::arg("cost"), py::arg("length"), py::arg("capacity"),
      "Eq. 3: (ranks, offload ratio) for one sequence.");
  m.def("static_cp_degree", &planner::staticCpDegree, py::arg("longest"), py::arg("capacity"),
        py::arg("world_size"),
        "The static DP x CP baseline's CP degree: the smallest power of two cp with cp x capacity >= "
        "longest; ValueError when it exceeds world_size.");
  m.def("ranks_without_offload", &planner::ranksWithoutOffload, py::arg("cost"), py::arg("length"),
        py::arg("capacity"));

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def_readonly("world_size", &Plan::world_size)
      .def_readonly("strategy", &Plan::strategy)
      .def_readonly("makespan", &Plan::makespan, "Synchronised step time (the replay's), seconds.")
      .def_readonly("max_busy", &Plan::max_busy, "Max over ranks of the sum of micro-batch costs.")
      .def_readonly("mean_cost", &Plan::mean_cost)
      .def_readonly("imbalance", &Plan::imbalance, "makespan / mean_cost.")
      .def_readonly("lower_bound", &Plan::lower_bound)
      .def_readonly("bound_work", &Plan::bound_work)
      .def_readonly("bound_piece", &Plan::bound_piece)
      .def_readonly("bound_waves", &Plan::bound_waves)
      .def_readonly("num_sequences", &Plan::num_sequences)
      .def_property_readonly("num_micro_batches", &Plan::numMicroBatches)
      .def_property_readonly("num_rings", &Plan::numRings)
#define BYTESCALE_VIEW(name)                                                                  \
  .def_property_readonly(#name, [](const std::shared_ptr<Plan>& p) { return view(p, p->name); })
      BYTESCALE_VIEW(rank_mb) BYTESCALE_VIEW(mb_seg) BYTESCALE_VIEW(mb_offload)
      BYTESCALE_VIEW(mb_cost) BYTESCALE_VIEW(mb_tokens) BYTESCALE_VIEW(mb_ring)
      BYTESCALE_VIEW(ring_grp) BYTESCALE_VIEW(grp_ranks) BYTESCALE_VIEW(seg_seq)
      BYTESCALE_VIEW(seg_ring_size) BYTESCALE_VIEW(seg_ring_pos) BYTESCALE_VIEW(seg_tokens)
      BYTESCALE_VIEW(rank_cost) BYTESCALE_VIEW(rank_finish) BYTESCALE_VIEW(rank_idle)
      BYTESCALE_VIEW(mb_slot) BYTESCALE_VIEW(mb_p2p)
#undef BYTESCALE_VIEW
      .def_readonly("pp", &Plan::pp, "The pipeline depth the plan was made for (1: none).")
      .def_readonly("pp_fwd_share", &Plan::pp_fwd_share)
      .def_property_readonly("pipelined", &Plan::pipelined,
                             "Whether micro-batches carry pipeline slots (mb_slot) and makespan is the "
                             "pipeline replay's.")
      .def("rank_micro_batches", &rankMicroBatches, py::arg("rank"))
      .def("to_bytes",
           [](const Plan& p) {
             auto b = p.serialize();
             return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def_static("from_bytes",
                  [](const py::bytes& b) {
                    std::string s = b;
                    return std::make_shared<Plan>(
                        Plan::deserialize(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
                  })
      .def(
          "verify",
          [](const Plan& p, const std::vector<int64_t>& lengths, const PlanOptions& o) {
            p.verify(lengths, o);
          },
          py::arg("lengths"), py::arg("options"));

  py::class_<ReplayResult, std::shared_ptr<ReplayResult>>(
      m, "ReplayResult", "A plan replayed in the runtime's model (csrc/planner/replay.h).")
      .def_readonly("step_time", &ReplayResult::step_time)
#define BYTESCALE_VIEW(name)                                                   \
  .def_property_readonly(#name, [](const std::shared_ptr<ReplayResult>& r) { return view(r, r->name); })
      BYTESCALE_VIEW(mb_start) BYTESCALE_VIEW(mb_end) BYTESCALE_VIEW(rank_finish)
      BYTESCALE_VIEW(rank_busy) BYTESCALE_VIEW(rank_idle)
#undef BYTESCALE_VIEW
      ;

  py::class_<PipelineReplay, std::shared_ptr<PipelineReplay>>(
      m, "PipelineReplay", "A pipelined plan replayed under 1F1B (csrc/planner/pipeline.h).")
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
  m.def("pipeline_replay", &pipelineReplayPlan, py::arg("plan"), py::arg("fwd") = py::none(),
        py::arg("bwd") = py::none(), py::arg("p2p") = py::none(),
        "Replays a pipelined plan under 1F1B: its own costs by default, or fwd / bwd (micro-batches x "
        "stages, row-major) and p2p (per micro-batch) seconds. ValueError on malformed input.");
  m.def(
      "pipeline_replay_schedule",
      [](int pipelines, int stages, Arr<int64_t> rank_mb, Arr<int64_t> mb_slot, Arr<int64_t> mb_ring,
         Arr<int64_t> ring_grp, Arr<int32_t> grp_ranks, Arr<double> fwd, Arr<double> bwd, Arr<double> p2p) {
        for (auto* a : {&rank_mb, &mb_slot, &mb_ring, &ring_grp}) check1d(*a, "schedule arrays");
        check1d(grp_ranks, "grp_ranks");
        if (pipelines < 1) throw py::value_error("pipelines must be >= 1, got " + std::to_string(pipelines));
        if (rank_mb.size() != pipelines + 1)
          throw py::value_error("rank_mb needs pipelines + 1 entries, got " + std::to_string(rank_mb.size()));
        if (ring_grp.size() < 1) throw py::value_error("ring_grp needs rings + 1 entries (at least [0])");
        const int64_t M = mb_ring.size();
        if (mb_slot.size() != M) throw py::value_error("mb_slot and mb_ring disagree in length");
        if (stages < 1) throw py::value_error("stages must be >= 1, got " + std::to_string(stages));
        if (fwd.size() != M * stages || bwd.size() != M * stages || p2p.size() != M)
          throw py::value_error("fwd and bwd need micro-batches x stages = " + std::to_string(M * stages) +
                                " entries and p2p " + std::to_string(M));
        planner::PipelineView v;
        v.sched.world_size = pipelines;
        v.sched.rank_mb = rank_mb.data();
        v.sched.num_mb = M;
        v.sched.mb_ring = mb_ring.data();
        v.sched.num_rings = ring_grp.size() - 1;
        v.sched.ring_grp = ring_grp.data();
        v.sched.grp_ranks = grp_ranks.data();
        v.sched.num_grp_ranks = grp_ranks.size();
        v.stages = stages;
        v.mb_slot = mb_slot.data();
        const double *f = fwd.data(), *b = bwd.data(), *x = p2p.data();
        py::gil_scoped_release nogil;
        return std::make_shared<PipelineReplay>(planner::replayPipeline(v, f, b, x, M));
      },
      py::arg("pipelines"), py::arg("stages"), py::arg("rank_mb"), py::arg("mb_slot"), py::arg("mb_ring"),
      py::arg("ring_grp"), py::arg("grp_ranks"), py::arg("fwd"), py::arg("bwd"), py::arg("p2p"),
      "pipeline_replay() on raw schedule arrays (a pipelined plan's layout).");
  m.def("one_f_one_b", &planner::oneFOneB, py::arg("slots"), py::arg("stages"), py::arg("stage"),
        "The 1F1B operations of one stage: 2k = forward of slot k, 2k + 1 = its backward.");
  m.def("stage_layers", &planner::stageLayers, py::arg("layers"), py::arg("stages"),
        "Layers per pipeline stage; ValueError when the stages do not divide the layers.");
  m.def("check_pipeline_depth", &planner::checkPipelineDepth, py::arg("plan"), py::arg("stages"),
        "ValueError when the plan was made for another pipeline depth.");

  m.def("replay", &replayPlan, py::arg("plan"), py::arg("durations") = py::none(),
        "Replays a plan: each rank runs its micro-batches in order, a ring micro-batch starts when "
        "all its members are free and ends at start + the largest duration among them. "
        "durations: per micro-batch (indexed like plan.mb_cost), default plan.mb_cost. Raises "
        "ValueError on a deadlocking order or malformed input.");
  m.def(
      "replay_schedule",
      [](int world_size, Arr<int64_t> rank_mb, Arr<int64_t> mb_ring, Arr<int64_t> ring_grp,
         Arr<int32_t> grp_ranks, Arr<double> durations) {
        check1d(rank_mb, "rank_mb");
        check1d(mb_ring, "mb_ring");
        check1d(ring_grp, "ring_grp");
        check1d(grp_ranks, "grp_ranks");
        check1d(durations, "durations");
        if (world_size < 1) throw py::value_error("world_size must be >= 1, got " + std::to_string(world_size));
        if (rank_mb.size() != world_size + 1)
          throw py::value_error("rank_mb needs world_size + 1 entries, got " + std::to_string(rank_mb.size()));
        if (ring_grp.size() < 1) throw py::value_error("ring_grp needs rings + 1 entries (at least [0])");
        planner::ScheduleView v;
        v.world_size = world_size;
        v.rank_mb = rank_mb.data();
        v.num_mb = mb_ring.size();
        v.mb_ring = mb_ring.data();
        v.num_rings = ring_grp.size() - 1;
        v.ring_grp = ring_grp.data();
        v.grp_ranks = grp_ranks.data();
        v.num_grp_ranks = grp_ranks.size();
        const double* d = durations.data();
        const int64_t n = durations.size();
        py::gil_scoped_release nogil;
        return std::make_shared<ReplayResult>(planner::replay(v, d, n));
      },
      py::arg("world_size"), py::arg("rank_mb"), py::arg("mb_ring"), py::arg("ring_grp"),
      py::arg("grp_ranks"), py::arg("durations"),
      "replay() on raw schedule arrays (a plan's layout): for schedules built outside the planner.");
  m.def(
      "lockstep",
      [](const Plan& p) {
        LockstepSlots s;
        {
          py::gil_scoped_release nogil;
          s = planner::lockstepSlots(p);
        }
        return lockstepArray(s);
      },
      py::arg("plan"),
      "FSDP2 lockstep slots: int64 [world_size, slots], the micro-batch index each rank runs in "
      "each slot, -1 for an empty (padding) slot. Ring members meet in the same slot.");

  py::class_<PlanOptions>(m, "PlanOptions")
      .def(py::init<>())
      .def_readwrite("world_size", &PlanOptions::world_size)
      .def_readwrite("capacity", &PlanOptions::capacity)
      .def_readwrite("speed", &PlanOptions::speed)
      .def_readwrite("memory", &PlanOptions::memory)
      .def_readwrite("cost", &PlanOptions::cost)
      .def_readwrite("offload", &PlanOptions::offload)
      .def_property(
          "offload_rule", [](const PlanOptions& o) { return planner::offloadRuleName(o.offload_rule); },
          [](PlanOptions& o, const std::string& s) { o.offload_rule = planner::parseOffloadRule(s); },
          "how offloading may shrink rings: 'step' (Eq. 3 under the step's clock, default) or "
          "'paper-eq3' (the paper's literal Eq. 3, for the ablation)")
      .def_readwrite("peer_budget", &PlanOptions::peer_budget,
                     "at most this many distinct ring neighbours per rank over the run (0: unbounded; "
                     ">= 4; csrc/planner/peer_budget.h)")
      .def_readwrite("static_cp", &PlanOptions::static_cp,
                     "strategy 'static': the CP degree (0: sized for the step's longest sequence)")
      .def_property(
          "pp", [](const PlanOptions& o) { return o.pipeline.stages; },
          [](PlanOptions& o, int v) { o.pipeline.stages = v; }, "pipeline depth P (1: none)")
      .def_property(
          "pp_fwd_share", [](const PlanOptions& o) { return o.pipeline.fwd_share; },
          [](PlanOptions& o, double v) { o.pipeline.fwd_share = v; })
      .def_property(
          "pp_p2p_bytes_per_token", [](const PlanOptions& o) { return o.pipeline.p2p_bytes_per_token; },
          [](PlanOptions& o, double v) { o.pipeline.p2p_bytes_per_token = v; })
      .def_property(
          "pp_p2p_bw", [](const PlanOptions& o) { return o.pipeline.p2p_bw; },
          [](PlanOptions& o, double v) { o.pipeline.p2p_bw = v; })
      .def_property(
          "pp_p2p_latency", [](const PlanOptions& o) { return o.pipeline.p2p_latency; },
          [](PlanOptions& o, double v) { o.pipeline.p2p_latency = v; })
      .def_property(
          "strategy", [](const PlanOptions& o) { return planner::strategyName(o.strategy); },
          [](PlanOptions& o, const std::string& s) { o.strategy = planner::parseStrategy(s); });

  m.def(
      "explain_rings",
      [](const Plan& p, const std::vector<int64_t>& lengths, const PlanOptions& opt) {
        auto rows = planner::explainRings(p, lengths, opt);
        py::list out;
        for (const auto& c : rows)
          out.append(py::make_tuple(c.ranks, c.ratio, c.floor_memory, c.floor_offload,
                                    planner::ringReasonName(c.reason)));
        return out;
      },
      py::arg("plan"), py::arg("lengths"), py::arg("options"),
      "Per sequence (input order): (ranks, offload ratio, ranks without offloading, Eq. 3's "
      "minimum, reason) with reason 'local' | 'memory' | 'copy-hiding' | 'step' | 'shape' "
      "(csrc/planner/offload_rule.h).");

  m.def(
      "reference_plan",
      [](const py::array& raw, const PlanOptions& opt, bool exact, int64_t budget, uint64_t seed,
         const std::shared_ptr<Plan>& start) {
        const char kind = raw.dtype().kind();
        if ((kind != 'i' && kind != 'u') || raw.ndim() != 1)
          throw py::value_error("reference_plan: lengths must be a 1-D integer array");
        if (budget < 1) throw py::value_error("reference_plan: budget must be >= 1, got " + std::to_string(budget));
        auto lengths = py::cast<Arr<int64_t>>(raw);
        std::vector<int64_t> v(lengths.data(), lengths.data() + lengths.size());
        planner::ReferencePlan r;
        {
          py::gil_scoped_release nogil;
          r = exact ? planner::exactReference(v, opt, budget)
                    : planner::searchReference(v, opt, budget, seed, start.get());
        }
        return py::make_tuple(std::make_shared<Plan>(std::move(r.plan)), r.optimal, r.work);
      },
      py::arg("lengths"), py::arg("options"), py::arg("exact") = false, py::arg("budget") = 20000,
      py::arg("seed") = 1, py::arg("start") = nullptr,
      "Reference schedules that measure the strategies (csrc/planner/reference.h): exact=True is "
      "the exhaustive search (at most 10 sequences and 16 ranks; budget = node limit), else a "
      "local search (budget = schedules evaluated) from a greedy start and from `start` (a plan of "
      "the same input). Returns (plan, optimal, work).");

  m.def(
      "make_plan",
      [](const py::array& raw, const PlanOptions& opt) {
        // Integer arrays only: a float length would be truncated silently by a cast.
        const char kind = raw.dtype().kind();
        if (kind != 'i' && kind != 'u')
          throw py::value_error("make_plan: lengths must be an integer array, got dtype " +
                                std::string(py::str(raw.dtype())) +
                                " (bytescale.planner.plan checks and converts every value)");
        if (raw.ndim() != 1) throw py::value_error("make_plan: lengths must be 1-D");
        auto lengths = py::cast<Arr<int64_t>>(raw);
        std::vector<int64_t> v(lengths.data(), lengths.data() + lengths.size());
        py::gil_scoped_release nogil;
        return std::make_shared<Plan>(planner::makePlan(v, opt));
      },
      py::arg("lengths"), py::arg("options"));

  m.def(
      "longest_sequence",
      [](const PlanOptions& opt) { return planner::Feasibility(opt).longest(); },
      py::arg("options"),
      "The largest L such that every sequence of 1..L tokens can be placed by a plan of these options "
      "(csrc/planner/feasibility.h); 2^40 when all can.");
  m.def(
      "sequence_fits",
      [](const Arr<int64_t>& lengths, const PlanOptions& opt) {
        if (lengths.ndim() != 1) throw py::value_error("sequence_fits: lengths must be 1-D");
        const planner::Feasibility f(opt);
        py::array_t<bool> out(lengths.size());
        const int64_t* in = lengths.data();
        bool* o = out.mutable_data();
        const int64_t n = lengths.size();
        {
          py::gil_scoped_release nogil;
          for (int64_t i = 0; i < n; ++i) o[i] = f.fits(in[i]);
        }
        return out;
      },
      py::arg("lengths"), py::arg("options"),
      "Per length: whether a plan of these options can place a sequence of that many tokens.");
}

}  // namespace bytescale
