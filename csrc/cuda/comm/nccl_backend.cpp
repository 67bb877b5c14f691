#include "cuda/comm/nccl_backend.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include "comm/device_backends.h"
#include "comm/staged_transport.h"
#include "common/env.h"

namespace bytescale {
namespace cuda {

namespace {

std::vector<int> iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

comm::DeviceBackend asPlugin(const c10::intrusive_ptr<NcclBackend>& backend) {
  comm::DeviceBackend plugin;
  plugin.transport = backend->transport();
  plugin.backend = backend;
  NcclBackend* raw = backend.get();  // the plug-in struct owns `backend`, so it outlives the call
  plugin.split = [raw](const comm::DeviceBackendOptions& g, int color, int key) {
    return raw->split(g, color, key);
  };
  std::weak_ptr<NcclTransport> weak = backend->transport();
  plugin.connected = [weak] {
    auto t = weak.lock();
    return t && t->comm().connected();
  };
  return plugin;
}

// The plug-in registers itself when the extension is loaded.
const bool kRegistered = [] {
  comm::registerDeviceBackend(c10::DeviceType::CUDA, [](const comm::DeviceBackendOptions& o) {
    // BYTESCALE_CUDA_TRANSPORT=staged: several processes on one GPU (comm/staged_transport.h).
    if (env::knobs().cuda_transport == "staged") return comm::makeStagedBackend(c10::DeviceType::CUDA, o);
    return asPlugin(c10::make_intrusive<NcclBackend>(o.store, o.rank, o.size, o.timeout));
  });
  return true;
}();

}  // namespace

NcclBackend::NcclBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                         std::chrono::milliseconds timeout, std::shared_ptr<NcclComm> comm)
    : comm::CollectiveBackend(std::make_shared<const comm::RankMap>(iota(size), size, rank),
                              "world group", timeout),
      transport_(std::make_shared<NcclTransport>(std::move(store), rank, size, timeout,
                                                 std::move(comm))) {
  (void)kRegistered;
}

comm::DeviceBackend NcclBackend::split(const comm::DeviceBackendOptions& g, int color, int key) {
  auto& parent = transport_->comm();
  if (!parent.connected()) {
    // No communicator to split (the world was not bound to a device): the group's own, created
    // by its members on its first collective; a non-member has nothing to do.
    if (color < 0) return {};
    return asPlugin(c10::make_intrusive<NcclBackend>(g.store, g.rank, g.size, g.timeout));
  }
  auto child = parent.split(color, key, g.store, g.rank, g.size, g.timeout);
  if (!child) return {};
  return asPlugin(c10::make_intrusive<NcclBackend>(g.store, g.rank, g.size, g.timeout,
                                                   std::move(child)));
}

NcclBackend::~NcclBackend() {
  try {
    shutdown();
  } catch (...) {
  }
}

void NcclBackend::shutdown() { transport_->shutdown(); }

void NcclBackend::abort() {
  transport_->abort("aborted by the user");
  transport_->shutdown();
}

void NcclBackend::eagerConnectSingleDevice(at::Device device) {
  transport_->comm().connect(device.index() < 0 ? static_cast<c10::DeviceIndex>(0)
                                                : device.index());
}

std::shared_ptr<comm::Transport> NcclBackend::p2pTransport(c10::DeviceType device,
                                                           const std::string& what) {
  TORCH_CHECK(device == c10::DeviceType::CUDA, "bytescale ", what, ": the NCCL backend takes "
              "CUDA tensors, got ", c10::DeviceTypeName(device));
  return transport_;
}

c10::intrusive_ptr<c10d::Work> NcclBackend::execute(comm::Collective c) {
  TORCH_CHECK(c.kind == comm::CollectiveKind::kBarrier || c.device == c10::DeviceType::CUDA,
              "bytescale ", c.what, ": the NCCL backend takes CUDA tensors, got ",
              c10::DeviceTypeName(c.device));
  NcclTransport::LaunchOptions opts;
  opts.connect = true;  // world collectives: every rank calls them
  if (c.kind == comm::CollectiveKind::kBarrier) {
    // An all-reduce of one element on the communicator's device; the CPU waits too.
    transport_->comm().require(c.what);
    at::Tensor token = at::zeros(
        {1}, at::TensorOptions().device(transport_->comm().device()).dtype(at::kFloat));
    c.inputs = c.outputs = {token};
    opts.cpu_sync = true;
  } else {
    // The communicator's device must exist before NCCL's buffers can be checked against it.
    const auto& any = !c.inputs.empty() ? c.inputs : c.outputs;
    transport_->comm().connect(any[0].device().index());
    checkNcclTensors(c.inputs, transport_->comm().device(), c.what);
    checkNcclTensors(c.outputs, transport_->comm().device(), c.what);
  }
  const int rank = getRank(), n = getSize();
  auto inf = info(c);
  std::vector<at::Tensor> outputs = c.outputs;
  return transport_->launch(
      std::move(inf), c.inputs, std::move(outputs),
      [&c, rank, n](ncclComm_t comm, cudaStream_t s) { enqueueCollective(c, rank, n, comm, s); },
      opts);
}

}  // namespace cuda
}  // namespace bytescale
