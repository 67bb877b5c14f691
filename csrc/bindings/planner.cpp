// Python bindings of the HDP planner. Plan arrays are exposed as read-only numpy views whose base
// is the Plan itself: no copies of large arrays.
#include "bindings/bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>

#include "planner/planner.h"

namespace py = pybind11;

namespace bytescale {

namespace {
using planner::CostModel;
using planner::Plan;
using planner::PlanOptions;

template <typename T>
py::array view(const std::shared_ptr<Plan>& owner, const std::vector<T>& v) {
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
    py::tuple group(p.mb_grp[m + 1] - p.mb_grp[m]);
    for (int64_t g = p.mb_grp[m]; g < p.mb_grp[m + 1]; ++g)
      group[g - p.mb_grp[m]] = py::int_(p.grp_ranks[g]);
    out.append(py::make_tuple(segs, group, p.mb_offload[m], p.mb_cost[m]));
  }
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
  m.def("ranks_without_offload", &planner::ranksWithoutOffload, py::arg("cost"), py::arg("length"),
        py::arg("capacity"));

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def_readonly("world_size", &Plan::world_size)
      .def_readonly("strategy", &Plan::strategy)
      .def_readonly("makespan", &Plan::makespan)
      .def_readonly("mean_cost", &Plan::mean_cost)
      .def_readonly("imbalance", &Plan::imbalance)
      .def_readonly("lower_bound", &Plan::lower_bound)
      .def_readonly("num_sequences", &Plan::num_sequences)
      .def_property_readonly("num_micro_batches", &Plan::numMicroBatches)
#define BYTESCALE_VIEW(name)                                                                  \
  .def_property_readonly(#name, [](const std::shared_ptr<Plan>& p) { return view(p, p->name); })
      BYTESCALE_VIEW(rank_mb) BYTESCALE_VIEW(mb_seg) BYTESCALE_VIEW(mb_grp)
      BYTESCALE_VIEW(mb_offload) BYTESCALE_VIEW(mb_cost) BYTESCALE_VIEW(mb_tokens)
      BYTESCALE_VIEW(mb_ring) BYTESCALE_VIEW(seg_seq) BYTESCALE_VIEW(seg_ring_size)
      BYTESCALE_VIEW(seg_ring_pos) BYTESCALE_VIEW(seg_tokens) BYTESCALE_VIEW(grp_ranks)
      BYTESCALE_VIEW(rank_cost)
#undef BYTESCALE_VIEW
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

  py::class_<PlanOptions>(m, "PlanOptions")
      .def(py::init<>())
      .def_readwrite("world_size", &PlanOptions::world_size)
      .def_readwrite("capacity", &PlanOptions::capacity)
      .def_readwrite("speed", &PlanOptions::speed)
      .def_readwrite("memory", &PlanOptions::memory)
      .def_readwrite("cost", &PlanOptions::cost)
      .def_readwrite("offload", &PlanOptions::offload)
      .def_property(
          "strategy", [](const PlanOptions& o) { return planner::strategyName(o.strategy); },
          [](PlanOptions& o, const std::string& s) { o.strategy = planner::parseStrategy(s); });

  m.def(
      "make_plan",
      [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> lengths,
         const PlanOptions& opt) {
        std::vector<int64_t> v(lengths.data(), lengths.data() + lengths.size());
        py::gil_scoped_release nogil;
        return std::make_shared<Plan>(planner::makePlan(v, opt));
      },
      py::arg("lengths"), py::arg("options"));
}

}  // namespace bytescale
