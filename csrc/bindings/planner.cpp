// Python bindings of the HDP planner. Plan arrays are exposed as read-only numpy views whose base
// is the Plan itself: no copies of large arrays.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
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
using planner::Plan;
using planner::PlanOptions;

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

// One read-only attribute per plan field (BYTESCALE_PLAN_FIELDS): arrays as numpy views of the plan.
template <typename T>
void planAttribute(py::class_<Plan, std::shared_ptr<Plan>>& c, const char* name, T Plan::*field, const char* doc) {
  c.def_readonly(name, field, doc);
}

template <typename T>
void planAttribute(py::class_<Plan, std::shared_ptr<Plan>>& c, const char* name, std::vector<T> Plan::*field,
                   const char* doc) {
  c.def_property_readonly(name, [field](const std::shared_ptr<Plan>& p) { return view(p, (*p).*field); }, doc);
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

  using PlanClass = py::class_<Plan, std::shared_ptr<Plan>>;
  PlanClass plan(m, "Plan", "A step's plan (csrc/planner/planner.h): flat arrays, read-only (numpy views, no copies).");
#define BYTESCALE_ATTR(type, name, init, since, doc) planAttribute(plan, #name, &Plan::name, doc);
  BYTESCALE_PLAN_FIELDS(BYTESCALE_ATTR)
#undef BYTESCALE_ATTR
  plan.def_property_readonly("num_micro_batches", &Plan::numMicroBatches)
      .def_property_readonly("num_rings", &Plan::numRings)
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

  m.def("stage_layers", &planner::stageLayers, py::arg("layers"), py::arg("stages"),
        "Layers per pipeline stage; ValueError when the stages do not divide the layers.");
  m.def("check_pipeline_depth", &planner::checkPipelineDepth, py::arg("plan"), py::arg("stages"),
        "ValueError when the plan was made for another pipeline depth.");

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

  bind_step_model(m);  // step_model.cpp: Schedule, replays, lockstep slots (needs Plan)
}

}  // namespace bytescale
