// Python bindings of the communication subsystem.
#include "bindings/bindings.h"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "comm/agreement.h"
#include "comm/backend.h"
#include "comm/dynamic_group.h"
#include "comm/consistency.h"
#include "comm/device_backends.h"
#include "comm/schedule.h"
#include "comm/staged_transport.h"
#include "comm/group_ops.h"
#include "comm/traffic.h"
#include "common/env.h"

namespace py = pybind11;

namespace bytescale {

namespace {

// A c10d ProcessGroup that reports "bytescale" as its backend's name (c10d's own reports "custom"
// for any plug-in backend; DDP's logging data and pg.name() read it). It lives in C++ on purpose:
// collectives on a Python subclass of c10d.ProcessGroup go through torch's trampoline, which runs
// the backend with the GIL held (PyProcessGroup's WORK_OVERRIDE); a communication thread that
// then drops the last reference to a Python-owned tensor waits for the GIL while the caller waits
// for it: a deadlock. Python subclasses of this class (bytescale.comm) add attributes only.
class NamedProcessGroup : public c10d::ProcessGroup {
 public:
  NamedProcessGroup(int rank, int size) : c10d::ProcessGroup(rank, size) {}
  // With the group's store: ProcessGroup::splitGroup (dist.split_group, DeviceMesh on a
  // device-bound world) makes its children's stores from it.
  NamedProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size)
      : c10d::ProcessGroup(store, rank, size) {}
  const std::string getBackendName() const override { return "bytescale"; }
};

}  // namespace

void bind_comm(py::module_& m) {
  using comm::BytescaleBackend;
  using comm::DynamicGroupBackend;
  // torch.distributed must be imported first so that c10d.Backend is a known pybind type.
  py::module_::import("torch.distributed");

  py::class_<NamedProcessGroup, c10d::ProcessGroup, c10::intrusive_ptr<NamedProcessGroup>>(
      m, "NamedProcessGroup",
      "A c10d ProcessGroup named 'bytescale' whose collectives dispatch in C++ without the GIL "
      "(subclass it from Python; do not override its collectives).")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"))
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int>(), py::arg("store"),
           py::arg("rank"), py::arg("size"));

  py::class_<BytescaleBackend, c10d::Backend, c10::intrusive_ptr<BytescaleBackend>>(
      m, "BytescaleBackend",
      "The world 'bytescale' backend: Gloo (CPU) and NCCL (CUDA) natives plus the transports "
      "dynamic groups and ring attention run on.")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout,
                       const c10::intrusive_ptr<c10d::Backend>& gloo) {
             return c10::make_intrusive<BytescaleBackend>(store, rank, size, timeout, gloo);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("gloo"),
           py::call_guard<py::gil_scoped_release>())
      .def_static(
          "static_group",
          [](const c10::intrusive_ptr<c10d::Store>& store, int rank,
             std::chrono::milliseconds timeout, const c10::intrusive_ptr<c10d::Backend>& gloo,
             std::vector<int> global_ranks, const py::object& parent) {
            c10::intrusive_ptr<c10d::Backend> owner;
            BytescaleBackend* p = nullptr;
            if (!parent.is_none()) {
              owner = parent.cast<c10::intrusive_ptr<c10d::Backend>>();
              p = dynamic_cast<BytescaleBackend*>(owner.get());
              TORCH_CHECK(p, "bytescale: a static group splits its CUDA communicator from a "
                          "bytescale backend, got ", owner->getBackendName());
            }
            py::gil_scoped_release nogil;
            return BytescaleBackend::makeStatic(store, rank, timeout, gloo,
                                                std::move(global_ranks), p);
          },
          py::arg("store"), py::arg("rank"), py::arg("timeout"), py::arg("gloo"),
          py::arg("global_ranks"), py::arg("parent") = py::none(),
          "A static group of `global_ranks` (this process at `rank`) on the Gloo context `gloo` "
          "of its members; its CUDA communicator is split from `parent`'s (every rank of the "
          "parent takes part; non-members through perform_nocolor_split) or, without a parent, "
          "created on the group's first CUDA collective.")
      .def("perform_nocolor_split", &BytescaleBackend::performNoColorSplit, py::arg("device"),
           py::call_guard<py::gil_scoped_release>(),
           "A non-member's part in a split of this group's CUDA communicator (torch calls it).")
      .def_property_readonly("is_world", &BytescaleBackend::isWorld)
      .def_property_readonly("global_ranks", &BytescaleBackend::globalRanks)
      .def_property_readonly("timeout", &BytescaleBackend::timeout)
      .def(
          "device_connected",
          [](const BytescaleBackend& b, const std::string& device) {
            return b.deviceConnected(c10::Device(device).type());
          },
          py::arg("device"),
          "Whether the world communicator of a device plug-in exists (cuda: the NCCL "
          "communicator, created by device_id= or the first world collective).")
      .def("_shutdown", &BytescaleBackend::shutdown, py::call_guard<py::gil_scoped_release>());

  py::class_<DynamicGroupBackend, c10d::Backend, c10::intrusive_ptr<DynamicGroupBackend>>(
      m, "DynamicGroupBackend",
      "Backend of a dynamic group: P2P algorithms on the world transports; no communicator.")
      .def(py::init([](std::vector<int> ranks, int world_size, int my_rank,
                       std::optional<std::chrono::milliseconds> timeout) {
             return c10::make_intrusive<DynamicGroupBackend>(
                 std::move(ranks), world_size, my_rank,
                 timeout.value_or(std::chrono::milliseconds(0)));
           }),
           py::arg("ranks"), py::arg("world_size"), py::arg("my_rank"),
           py::arg("timeout") = py::none(),
           "timeout: how long its operations may take (default: the world group's timeout).")
      .def_property_readonly("ranks",
                             [](const DynamicGroupBackend& b) { return b.rankMap().ranks(); })
      .def_property_readonly("timeout", &DynamicGroupBackend::timeout)
      .def_property_readonly("group_rank",
                             [](const DynamicGroupBackend& b) { return b.rankMap().myIndex(); })
      .def_property_readonly("next_rank",
                             [](const DynamicGroupBackend& b) {
                               b.rankMap().requireMember("next_rank");
                               return b.rankMap().next();
                             })
      .def_property_readonly("prev_rank",
                             [](const DynamicGroupBackend& b) {
                               b.rankMap().requireMember("prev_rank");
                               return b.rankMap().prev();
                             })
      .def("ring_exchange", &DynamicGroupBackend::ringExchange, py::arg("send"), py::arg("recv"),
           py::call_guard<py::gil_scoped_release>(),
           "Send `send` to the next member and receive into `recv` from the previous one, as one "
           "batched step. Returns a Work.");

  m.def(
      "has_world_transport",
      [](const std::string& device) {
        return comm::worldTransport(c10::Device(device).type()) != nullptr;
      },
      py::arg("device"));

  m.def(
      "has_device_backend",
      [](const std::string& device) { return comm::hasDeviceBackend(c10::Device(device).type()); },
      py::arg("device"),
      "True when a communication plug-in registered itself for the device type (cuda: the NCCL "
      "backend of CUDA builds).");

  m.def(
      "agree",
      [](const std::vector<int64_t>& payload, const std::string& what, const std::string& kind,
         std::optional<std::vector<int>> ranks) {
        auto host = comm::hostChannel();
        TORCH_CHECK(host, "bytescale.comm.agree (", what,
                    "): call dist.init_process_group(\"bytescale\") first");
        std::vector<int> members;
        if (ranks) {
          members = *ranks;
        } else {
          for (int r = 0; r < host->worldSize(); ++r) members.push_back(r);
        }
        comm::AgreementKind k = comm::AgreementKind::kUser;
        if (kind == "plan")
          k = comm::AgreementKind::kPlan;
        else
          TORCH_CHECK(kind == "user", "bytescale.comm.agree: kind must be 'plan' or 'user', got '",
                      kind, "'");
        comm::RankMap g(std::move(members), host->worldSize(), host->rank());
        return comm::agree(*host, g, k, payload, what);
      },
      py::arg("payload"), py::arg("what"), py::arg("kind") = "user", py::arg("ranks") = py::none(),
      py::call_guard<py::gil_scoped_release>(),
      "The agreement primitive (csrc/comm/agreement.h) on the host channel: every member of "
      "`ranks` (default: the world) sends its int64 payload (at most 15 values) and gets every "
      "member's, padded to 15, in group order.");
  // The staged transport on CPU tensors (tests/comm/test_staged_transport.py): the same staging
  // code the CUDA plug-in runs with BYTESCALE_CUDA_TRANSPORT=staged.
  m.def(
      "_staged_ring_step",
      [](const at::Tensor& send, const at::Tensor& recv, std::vector<int> ranks, bool posted) {
        auto cpu = comm::requireTransport(c10::DeviceType::CPU, "staged ring step");
        auto tr = std::make_shared<comm::StagedTransport>(send.device().type(), cpu);
        comm::RankMap g(std::move(ranks), cpu->worldSize(), cpu->rank());
        auto ops = comm::Transport::ringStepOps(send, g.next(), recv, g.prev());
        if (posted) {
          comm::WorkInfo info;
          info.what = "staged ring step";
          info.timeout = cpu->timeout();
          tr->post(ops, info)->wait();
        } else {
          tr->exchange(ops, "staged ring step")->wait();
        }
      },
      py::arg("send"), py::arg("recv"), py::arg("ranks"), py::arg("posted") = false,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_staged_all_reduce",
      [](const at::Tensor& t, std::vector<int> ranks) {
        auto cpu = comm::requireTransport(c10::DeviceType::CPU, "staged all_reduce");
        auto tr = std::make_shared<comm::StagedTransport>(t.device().type(), cpu);
        auto g = std::make_shared<const comm::RankMap>(std::move(ranks), cpu->worldSize(),
                                                       cpu->rank());
        comm::WorkInfo info;
        info.what = "staged all_reduce";
        info.timeout = cpu->timeout();
        tr->run(info, {t}, [tr, g, t] {
              comm::group_ops::allReduce(*tr, *g, t, c10d::ReduceOp(c10d::ReduceOp::SUM),
                                         "staged all_reduce");
            }, {t})->wait();
      },
      py::arg("tensor"), py::arg("ranks"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "_staged_group_backend",
      [](const c10::intrusive_ptr<c10d::Backend>& group) -> c10::intrusive_ptr<c10d::Backend> {
        // The staged plug-in a static group gets on a GPU (BYTESCALE_CUDA_TRANSPORT=staged), here
        // for CPU tensors: group_ops over the group's own CPU transport (its ranks 0..k-1).
        auto* b = dynamic_cast<BytescaleBackend*>(group.get());
        TORCH_CHECK(b, "bytescale: _staged_group_backend takes a bytescale backend, got ",
                    group->getBackendName());
        comm::DeviceBackendOptions o;
        o.rank = b->getRank();
        o.size = b->getSize();
        o.timeout = b->timeout();
        o.cpu = b->transport(c10::DeviceType::CPU);
        return comm::makeStagedBackend(c10::DeviceType::CPU, o).backend;
      },
      py::arg("group_backend"));
  m.def(
      "cuda_transport", [] { return env::knobs().cuda_transport; },
      "The transport of CUDA tensors: 'nccl' (default) or 'staged' (BYTESCALE_CUDA_TRANSPORT).");
  m.def(
      "nccl_order", [] { return env::knobs().nccl_order; },
      "True when BYTESCALE_NCCL_ORDER=1 (CUDA's execution model on CPU, for tests).");

  m.def("collective_checks_enabled", &comm::checksEnabled);
  m.def("set_collective_checks", &comm::setChecksEnabled, py::arg("enabled"),
        "Turn the cross-rank consistency check of CPU collectives on or off (default on; env "
        "BYTESCALE_CHECK_COLLECTIVES=0). Set it identically on every rank.");

  // Traffic counters (comm/traffic.h).
  m.def(
      "traffic_snapshot",
      [](bool reset) {
        const auto snap = comm::trafficSnapshot(reset);
        py::dict out;
        for (int i = 0; i < static_cast<int>(comm::Traffic::kCount); ++i) {
          const auto& r = snap.rows[i];
          out[comm::trafficName(static_cast<comm::Traffic>(i))] =
              py::make_tuple(r.sent_bytes, r.recv_bytes, r.ops);
        }
        out["ring_wait_ns"] = snap.ring_wait_ns;
        out["peers"] = snap.peers;
        return out;
      },
      py::arg("reset") = false,
      "This process's traffic counters: {purpose: (bytes sent, bytes received, ring steps or "
      "collectives)} plus ring_wait_ns and peers (distinct point-to-point peers, cumulative); "
      "reset=True restarts them from zero (all but peers).");
  m.def("reset_traffic_peers", &comm::resetTrafficPeers,
        "Forget the point-to-point peers counted so far (comm/traffic.h).");
  m.def(
      "set_traffic_scope",
      [](const std::string& name) {
        const char* prev = comm::trafficName(comm::TrafficScope::current());
        int found = -1;
        for (int i = 0; i < static_cast<int>(comm::Traffic::kCount); ++i)
          if (name == comm::trafficName(static_cast<comm::Traffic>(i))) found = i;
        TORCH_CHECK(found >= 0, "bytescale set_traffic_scope: unknown purpose '", name, "'");
        comm::setTrafficScope(static_cast<comm::Traffic>(found));
        return std::string(prev);
      },
      py::arg("purpose"),
      "Set the purpose the calling thread's traffic is counted under; returns the previous one.");

  // Schedules, exposed for tests and introspection.
  m.def(
      "ring_all_gather_schedule",
      [](int n, int pos) {
        std::vector<std::pair<int, int>> out;
        for (auto s : comm::ringAllGatherSchedule(n, pos)) out.emplace_back(s.send_block, s.recv_block);
        return out;
      },
      py::arg("n"), py::arg("position"));
}

}  // namespace bytescale
