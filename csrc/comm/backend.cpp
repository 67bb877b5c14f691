#include "comm/backend.h"

#include <ATen/ATen.h>

#include <unordered_map>

#include "comm/group_ops.h"
#include "comm/work.h"

#if defined(BYTESCALE_WITH_CUDA) && __has_include("cuda/nccl_backend.h")
#include "cuda/nccl_backend.h"
#define BYTESCALE_HAVE_NCCL 1
#endif

namespace bytescale {
namespace comm {

// ---- the process's world transports --------------------------------------------------------------

namespace {
std::mutex g_registry_mu;
// Never destroyed: a transport still registered at process exit (a process group that was not
// destroyed) must not run its destructor after the CUDA driver has shut down.
std::unordered_map<int, std::shared_ptr<Transport>>& registry() {
  static auto* r = new std::unordered_map<int, std::shared_ptr<Transport>>();
  return *r;
}
}  // namespace

std::shared_ptr<Transport> worldTransport(c10::DeviceType device) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = registry().find(static_cast<int>(device));
  return it == registry().end() ? nullptr : it->second;
}

void registerWorldTransport(c10::DeviceType device, std::shared_ptr<Transport> transport) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  registry()[static_cast<int>(device)] = std::move(transport);
}

void unregisterWorldTransport(c10::DeviceType device, const Transport* transport) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = registry().find(static_cast<int>(device));
  if (it != registry().end() && it->second.get() == transport) registry().erase(it);
}

// ---- BytescaleBackend ------------------------------------------------------------------------------

namespace {
std::vector<int> iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}
bool needsGroupOps(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::AVG || op.op_ == c10d::ReduceOp::PREMUL_SUM;
}
}  // namespace

BytescaleBackend::BytescaleBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                   std::chrono::milliseconds timeout,
                                   c10::intrusive_ptr<c10d::Backend> gloo)
    : c10d::Backend(rank, size),
      store_(std::move(store)),
      timeout_(timeout),
      world_(std::make_shared<const RankMap>(iota(size), size, rank)),
      gloo_(std::move(gloo)) {
  TORCH_CHECK(gloo_, "bytescale: the world backend needs a Gloo backend for CPU tensors");
  cpu_ = std::make_shared<GlooTransport>(gloo_, rank, size, timeout);
  registerWorldTransport(c10::DeviceType::CPU, cpu_);
#ifdef BYTESCALE_HAVE_NCCL
  // Register the CUDA transport now (its communicator is still created lazily, by the first
  // world collective on a CUDA tensor or by device_id=), so dynamic groups and ring attention
  // find it and can say precisely what is missing.
  if (at::hasCUDA()) native(c10::DeviceType::CUDA, "init");
#endif
}

BytescaleBackend::~BytescaleBackend() {
  try {
    shutdown();
  } catch (...) {
  }
}

void BytescaleBackend::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  unregisterWorldTransport(c10::DeviceType::CPU, cpu_.get());
  if (cuda_) unregisterWorldTransport(c10::DeviceType::CUDA, cuda_.get());
  cpu_->shutdown();
  if (nccl_) nccl_->shutdown();
}

void BytescaleBackend::abort() {
  if (nccl_) nccl_->abort();
  shutdown();
}

std::shared_ptr<Transport> BytescaleBackend::transport(c10::DeviceType device) const {
  return device == c10::DeviceType::CPU ? std::static_pointer_cast<Transport>(cpu_) : cuda_;
}

c10d::Backend& BytescaleBackend::native(c10::DeviceType device, const std::string& what) {
  TORCH_CHECK(!shut_down_, "bytescale ", what, ": the backend has been shut down");
  if (device == c10::DeviceType::CPU) return *gloo_;
  TORCH_CHECK(device == c10::DeviceType::CUDA, "bytescale ", what, ": unsupported device type ",
              c10::DeviceTypeName(device), " (bytescale handles cpu and cuda tensors)");
#ifdef BYTESCALE_HAVE_NCCL
  if (!nccl_) {
    nccl_ = cuda::makeNcclBackend(store_, getRank(), getSize(), timeout_);
    cuda_ = cuda::transportOf(nccl_);
    registerWorldTransport(c10::DeviceType::CUDA, cuda_);
  }
  return *nccl_;
#else
  TORCH_CHECK(false, "bytescale ", what,
              ": CUDA tensors need bytescale built with CUDA (this build is CPU-only)");
#endif
}

void BytescaleBackend::eagerConnectSingleDevice(at::Device device) {
  if (device.type() != c10::DeviceType::CUDA) return;
  native(c10::DeviceType::CUDA, "eager connect");
#ifdef BYTESCALE_HAVE_NCCL
  cuda::eagerConnect(nccl_, device.index());
#endif
}

void BytescaleBackend::check(c10::DeviceType dt, int op, const at::Tensor& t, bool shape_known,
                             int64_t extra, const std::string& what) {
  if (dt != c10::DeviceType::CPU || !group_ops::checksEnabled() || getSize() == 1) return;
  // Through Gloo's own all-gather (fixed size, so it cannot mismatch), NOT bytescale's P2P
  // channel: world collectives may be issued while ring attention's P2P traffic is in flight
  // (e.g. DDP-style gradient buckets during a ring micro-batch's backward), and only Gloo's
  // collective ordering is common to all ranks then.
  at::Tensor fp = group_ops::fingerprint(static_cast<group_ops::OpCode>(op), t, shape_known, extra);
  at::Tensor flat = at::empty({getSize() * group_ops::kFingerprintLen}, fp.options());
  gloo_->_allgather_base(flat, fp)->wait();
  group_ops::verifyFingerprints(flat.view({getSize(), group_ops::kFingerprintLen}), *world_, what);
}

template <typename F>
c10::intrusive_ptr<c10d::Work> BytescaleBackend::checked(c10::DeviceType dt,
                                                          const std::string& what,
                                                          std::vector<Fingerprint> fps,
                                                          std::vector<at::Tensor> outs, F launch) {
  if (dt != c10::DeviceType::CPU || !group_ops::checksEnabled() || getSize() == 1) return launch();
  TORCH_CHECK(!shut_down_, "bytescale ", what, ": the backend has been shut down");
  // The check is a blocking exchange, so the check AND the Gloo collective run on the CPU
  // transport's worker thread: the caller never blocks (a collective issued from an autograd hook
  // while a peer is still in ring attention must not stall this rank's own ring traffic), and
  // all checked collectives keep one order per rank.
  return cpu_->run(what, std::move(outs), [this, dt, what, fps = std::move(fps), launch]() mutable {
    for (const auto& f : fps) check(dt, f.op, f.t, f.shape_known, f.extra, what);
    launch()->wait();
  });
}

template <typename F>
c10::intrusive_ptr<c10d::Work> BytescaleBackend::viaGroupOps(const std::string& what,
                                                              std::vector<at::Tensor> outs,
                                                              F body) {
  TORCH_CHECK(!shut_down_, "bytescale ", what, ": the backend has been shut down");
  auto tr = cpu_;
  auto world = world_;
  return tr->run(what, std::move(outs), [tr, world, body = std::move(body)]() { body(*tr, *world); });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  auto dt = deviceTypeOf(tensors, "broadcast");
  auto& nat = native(dt, "broadcast");
  std::vector<Fingerprint> fps;
  for (const auto& t : tensors) fps.push_back({static_cast<int>(group_ops::OpCode::kBroadcast), t, true, opts.rootRank});
  return checked(dt, "broadcast", fps, tensors, [&nat, tensors, opts]() mutable {
    return nat.broadcast(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  auto dt = deviceTypeOf(tensors, "all_reduce");
  if (!isCuda(dt) && needsGroupOps(opts.reduceOp)) {
    std::string what = "all_reduce";
    auto op = opts.reduceOp;
    for (const auto& t : tensors) group_ops::checkReduceOp(op, t, what);
    return viaGroupOps(what, tensors, [tensors, op, what](Transport& tr, const RankMap& g) {
      for (const auto& t : tensors) group_ops::allReduce(tr, g, t, op, what);
    });
  }
  auto& nat = native(dt, "all_reduce");
  std::vector<Fingerprint> fps;
  for (const auto& t : tensors) fps.push_back({static_cast<int>(group_ops::OpCode::kAllReduce), t, true, opts.reduceOp.op_});
  return checked(dt, "all_reduce", fps, tensors, [&nat, tensors, opts]() mutable {
    return nat.allreduce(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  auto dt = deviceTypeOf(tensors, "all_reduce_coalesced");
  if (!isCuda(dt) && needsGroupOps(opts.reduceOp)) return allreduce(tensors, opts);
  auto& nat = native(dt, "all_reduce_coalesced");
  std::vector<Fingerprint> fps;
  for (const auto& t : tensors) fps.push_back({static_cast<int>(group_ops::OpCode::kAllReduce), t, true, opts.reduceOp.op_});
  return checked(dt, "all_reduce_coalesced", fps, tensors, [&nat, tensors, opts]() mutable {
    return nat.allreduce_coalesced(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  auto dt = deviceTypeOf(tensors, "reduce");
  if (!isCuda(dt) && needsGroupOps(opts.reduceOp)) {
    std::string what = "reduce";
    auto op = opts.reduceOp;
    int root = static_cast<int>(opts.rootRank);
    return viaGroupOps(what, tensors, [tensors, op, root, what](Transport& tr, const RankMap& g) {
      for (const auto& t : tensors) group_ops::reduce(tr, g, t, op, root, what);
    });
  }
  auto& nat = native(dt, "reduce");
  std::vector<Fingerprint> fps;
  for (const auto& t : tensors) fps.push_back({static_cast<int>(group_ops::OpCode::kReduce), t, true, opts.rootRank});
  return checked(dt, "reduce", fps, tensors, [&nat, tensors, opts]() mutable {
    return nat.reduce(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto dt = deviceTypeOf(inputs, "all_gather");
  auto& nat = native(dt, "all_gather");
  std::vector<Fingerprint> fps;
  for (const auto& t : inputs) fps.push_back({static_cast<int>(group_ops::OpCode::kAllGather), t, true, 0});
  std::vector<at::Tensor> outs;
  for (const auto& l : outputs) outs.insert(outs.end(), l.begin(), l.end());
  return checked(dt, "all_gather", fps, outs, [&nat, outputs, inputs, opts]() mutable {
    return nat.allgather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  auto dt = deviceTypeOf({output, input}, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "bytescale all_gather_into_tensor: "
              "output has ", output.numel(), " elements but world size ", getSize(), " x input ",
              input.sizes(), " needs ", input.numel() * getSize());
  auto& nat = native(dt, "all_gather_into_tensor");
  return checked(dt, "all_gather_into_tensor", {{static_cast<int>(group_ops::OpCode::kAllGather), input, true, 0}}, {output},
                 [&nat, output, input, opts]() mutable { return nat._allgather_base(output, input, opts); });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto dt = deviceTypeOf(inputs, "all_gather_coalesced");
  auto& nat = native(dt, "all_gather_coalesced");
  std::vector<Fingerprint> fps;
  for (const auto& t : inputs) fps.push_back({static_cast<int>(group_ops::OpCode::kAllGather), t, true, 0});
  std::vector<at::Tensor> outs;
  for (const auto& l : outputs) outs.insert(outs.end(), l.begin(), l.end());
  return checked(dt, "all_gather_coalesced", fps, outs, [&nat, outputs, inputs, opts]() mutable {
    return nat.allgather_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  std::string what = "all_gather_into_tensor_coalesced";
  auto dt = deviceTypeOf(inputs, what);
  if (isCuda(dt)) return native(dt, what).allgather_into_tensor_coalesced(outputs, inputs, opts);
  TORCH_CHECK(outputs.size() == inputs.size(), "bytescale ", what, ": ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  return viaGroupOps(what, outputs, [outputs, inputs, what](Transport& tr, const RankMap& g) {
    for (size_t k = 0; k < inputs.size(); ++k)
      group_ops::allGather(tr, g, outputs[k], inputs[k], what);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  auto dt = deviceTypeOf(inputs, "gather");
  auto& nat = native(dt, "gather");
  std::vector<Fingerprint> fps;
  for (const auto& t : inputs) fps.push_back({static_cast<int>(group_ops::OpCode::kGather), t, true, opts.rootRank});
  std::vector<at::Tensor> outs;
  for (const auto& l : outputs) outs.insert(outs.end(), l.begin(), l.end());
  return checked(dt, "gather", fps, outs, [&nat, outputs, inputs, opts]() mutable {
    return nat.gather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  auto dt = deviceTypeOf(outputs, "scatter");
  auto& nat = native(dt, "scatter");
  std::vector<Fingerprint> fps;
  for (const auto& t : outputs) fps.push_back({static_cast<int>(group_ops::OpCode::kScatter), t, true, opts.rootRank});
  return checked(dt, "scatter", fps, outputs, [&nat, outputs, inputs, opts]() mutable {
    return nat.scatter(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  std::string what = "reduce_scatter";
  auto dt = deviceTypeOf(outputs, what);
  if (isCuda(dt)) return native(dt, what).reduce_scatter(outputs, inputs, opts);
  TORCH_CHECK(outputs.size() == inputs.size(), "bytescale ", what, ": ", outputs.size(),
              " outputs for ", inputs.size(), " input lists");
  for (size_t k = 0; k < inputs.size(); ++k)
    TORCH_CHECK(static_cast<int>(inputs[k].size()) == getSize(), "bytescale ", what,
                ": input list has ", inputs[k].size(), " tensors for world size ", getSize());
  auto op = opts.reduceOp;
  return viaGroupOps(what, outputs, [outputs, inputs, op, what](Transport& tr, const RankMap& g) {
    for (size_t k = 0; k < outputs.size(); ++k) {
      std::vector<at::Tensor> flat;
      for (const auto& t : inputs[k]) flat.push_back(t.reshape(-1));
      group_ops::reduceScatter(tr, g, outputs[k], at::cat(flat), op, what);
    }
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  std::string what = "reduce_scatter_tensor";
  auto dt = deviceTypeOf({output, input}, what);
  if (isCuda(dt)) return native(dt, what)._reduce_scatter_base(output, input, opts);
  auto op = opts.reduceOp;
  group_ops::checkReduceOp(op, input, what);
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "bytescale ", what, ": input has ",
              input.numel(), " elements but world size ", getSize(), " x output ", output.sizes(),
              " needs ", output.numel() * getSize());
  return viaGroupOps(what, {output}, [output, input, op, what](Transport& tr, const RankMap& g) {
    group_ops::reduceScatter(tr, g, output, input, op, what);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  std::string what = "reduce_scatter_tensor_coalesced";
  auto dt = deviceTypeOf(inputs, what);
  if (isCuda(dt)) return native(dt, what).reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  TORCH_CHECK(outputs.size() == inputs.size(), "bytescale ", what, ": ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  auto op = opts.reduceOp;
  return viaGroupOps(what, outputs, [outputs, inputs, op, what](Transport& tr, const RankMap& g) {
    for (size_t k = 0; k < inputs.size(); ++k)
      group_ops::reduceScatter(tr, g, outputs[k], inputs[k], op, what);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  auto dt = deviceTypeOf({output, input}, "all_to_all_single");
  auto& nat = native(dt, "all_to_all_single");
  return checked(dt, "all_to_all_single", {{static_cast<int>(group_ops::OpCode::kAllToAll), input, false, 0}}, {output},
                 [&nat, output, input, output_splits, input_splits, opts]() mutable {
                   return nat.alltoall_base(output, input, output_splits, input_splits, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  std::string what = "all_to_all";
  auto dt = deviceTypeOf(inputs, what);
  if (isCuda(dt)) return native(dt, what).alltoall(outputs, inputs, opts);
  // Gloo has no list all-to-all on every torch version: pairwise exchange over the transport.
  const int n = getSize();
  TORCH_CHECK(static_cast<int>(outputs.size()) == n && static_cast<int>(inputs.size()) == n,
              "bytescale ", what, ": needs ", n, " input and output tensors, got ", inputs.size(),
              " and ", outputs.size());
  return viaGroupOps(what, outputs, [outputs, inputs, what](Transport& tr, const RankMap& g) {
    group_ops::allToAllList(tr, g, outputs, inputs, what);
  });
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::send(std::vector<at::Tensor>& tensors,
                                                      int dst_rank, int tag) {
  auto dt = deviceTypeOf(tensors, "send");
  TORCH_CHECK(tensors.size() == 1, "bytescale send: expects exactly one tensor");
  {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    if (coalescer_.active()) {
      coalescer_.add(dt, {P2POp::kSend, dst_rank, tensors[0], tag});
      return completedWork(getRank(), c10d::OpType::SEND, tensors);
    }
  }
  return native(dt, "send").send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::recv(std::vector<at::Tensor>& tensors,
                                                      int src_rank, int tag) {
  auto dt = deviceTypeOf(tensors, "recv");
  TORCH_CHECK(tensors.size() == 1, "bytescale recv: expects exactly one tensor");
  {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    if (coalescer_.active()) {
      coalescer_.add(dt, {P2POp::kRecv, src_rank, tensors[0], tag});
      return completedWork(getRank(), c10d::OpType::RECV, tensors);
    }
  }
  return native(dt, "recv").recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::barrier(const c10d::BarrierOptions& opts) {
  // Ordered with the other checked CPU collectives (they run on the transport's worker).
  auto gloo = gloo_;
  return checked(c10::DeviceType::CPU, "barrier", {}, {}, [gloo, opts]() mutable {
    return gloo->barrier(opts);
  });
}

void BytescaleBackend::startCoalescing() {
  std::lock_guard<std::mutex> g(coalesce_mu_);
  coalescer_.start("coalescing");
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::endCoalescing() {
  std::vector<P2POp> ops;
  c10::DeviceType dt;
  {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    dt = coalescer_.device();
    ops = coalescer_.take("coalescing");
  }
  if (ops.empty()) return completedWork(getRank(), c10d::OpType::COALESCED, {});
  std::vector<at::Tensor> tensors;
  for (const auto& op : ops) tensors.push_back(op.tensor);
  if (isCuda(dt)) {
    // NCCL groups the sends/recvs issued between its own start/endCoalescing.
    auto& nccl = native(dt, "batch_isend_irecv");
    nccl.startCoalescing();
    for (auto& op : ops) {
      std::vector<at::Tensor> one{op.tensor};
      if (op.kind == P2POp::kSend)
        nccl.send(one, op.peer, op.tag < 0 ? 0 : op.tag);
      else
        nccl.recv(one, op.peer, op.tag < 0 ? 0 : op.tag);
    }
    return nccl.endCoalescing();
  }
  // CPU: Gloo sends/recvs with the user's tags, so a batch matches plain isend/irecv on the peer.
  return c10::make_intrusive<ExchangeWork>(getRank(), c10d::OpType::COALESCED,
                                           cpu_->exchange(ops, "batch_isend_irecv"),
                                           std::move(tensors));
}

}  // namespace comm
}  // namespace bytescale
