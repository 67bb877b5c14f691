#include "comm/dynamic_group.h"

#include <ATen/ATen.h>

#include "comm/group_ops.h"
#include "comm/work.h"

namespace bytescale {
namespace comm {

// ---- helpers shared with the world backend -----------------------------------------------------

std::shared_ptr<Transport> requireTransport(c10::DeviceType device, const std::string& what) {
  auto tr = worldTransport(device);
  TORCH_CHECK(tr, "bytescale ", what, ": no bytescale transport for ", c10::DeviceTypeName(device),
              " tensors (call dist.init_process_group(\"bytescale\") first",
              device == c10::DeviceType::CUDA
                  ? "; on CUDA the world NCCL communicator is created by init_process_group(..., "
                    "device_id=torch.device(\"cuda\", local_rank)) or by the first world "
                    "collective on a CUDA tensor, on every rank; and bytescale must be built with CUDA)"
                  : ")");
  return tr;
}

c10::DeviceType deviceTypeOf(const std::vector<at::Tensor>& tensors, const std::string& what) {
  TORCH_CHECK(!tensors.empty(), "bytescale ", what, ": no tensors given");
  c10::DeviceType dt = tensors[0].device().type();
  for (const auto& t : tensors) {
    TORCH_CHECK(t.defined(), "bytescale ", what, ": undefined tensor");
    TORCH_CHECK(t.device().type() == dt, "bytescale ", what, ": tensors on mixed devices (",
                tensors[0].device(), " and ", t.device(), ")");
    TORCH_CHECK(!t.is_sparse(), "bytescale ", what, ": sparse tensors are not supported");
  }
  return dt;
}

void P2PCoalescer::start(const std::string& who) {
  TORCH_CHECK(!active_, "bytescale ", who, ": startCoalescing called twice without endCoalescing");
  active_ = true;
  have_device_ = false;
  ops_.clear();
}

void P2PCoalescer::add(c10::DeviceType device, P2POp op) {
  if (have_device_)
    TORCH_CHECK(device == device_, "bytescale: coalesced point-to-point ops on mixed devices");
  device_ = device;
  have_device_ = true;
  ops_.push_back(std::move(op));
}

std::vector<P2POp> P2PCoalescer::take(const std::string& who) {
  TORCH_CHECK(active_, "bytescale ", who, ": endCoalescing without startCoalescing");
  active_ = false;
  std::vector<P2POp> ops;
  ops.swap(ops_);
  return ops;
}

c10::intrusive_ptr<c10d::Work> P2PCoalescer::end(int rank, const std::string& who) {
  std::vector<P2POp> ops = take(who);
  if (ops.empty()) return completedWork(rank, c10d::OpType::COALESCED, {});
  std::vector<at::Tensor> tensors;
  for (const auto& op : ops) tensors.push_back(op.tensor);
  auto tr = requireTransport(device_, who);
  return c10::make_intrusive<ExchangeWork>(rank, c10d::OpType::COALESCED,
                                           tr->exchange(ops, who + " batch_isend_irecv"),
                                           std::move(tensors));
}

// ---- DynamicGroupBackend -------------------------------------------------------------------------

DynamicGroupBackend::DynamicGroupBackend(std::vector<int> ranks, int world_size,
                                         int my_global_rank)
    : c10d::Backend(RankMap(ranks, world_size, my_global_rank).myIndex(),
                    static_cast<int>(ranks.size())),
      map_(std::make_shared<const RankMap>(std::move(ranks), world_size, my_global_rank)) {}

std::string DynamicGroupBackend::opName(const char* op) const {
  return std::string(op) + " on dynamic group " + map_->describe();
}

namespace {
// Runs `body(transport, map)` asynchronously on the transport of the tensors' device.
template <typename F>
c10::intrusive_ptr<c10d::Work> launch(const std::shared_ptr<const RankMap>& map,
                                      const std::string& what, c10::DeviceType device,
                                      std::vector<at::Tensor> outputs, F body) {
  map->requireMember(what);
  auto tr = requireTransport(device, what);
  Transport* raw = tr.get();
  return tr->run(what, std::move(outputs), [tr, raw, map, what, body = std::move(body)]() {
    body(*raw, *map);
  });
}
}  // namespace

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  auto what = opName("broadcast");
  auto dt = deviceTypeOf(tensors, what);
  int root = static_cast<int>(opts.rootRank);
  return launch(map_, what, dt, tensors, [tensors, root, what](Transport& tr, const RankMap& g) {
    for (const auto& t : tensors) group_ops::broadcast(tr, g, t, root, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  auto what = opName("all_reduce");
  auto dt = deviceTypeOf(tensors, what);
  auto op = opts.reduceOp;
  for (const auto& t : tensors) group_ops::checkReduceOp(op, t, what);
  return launch(map_, what, dt, tensors, [tensors, op, what](Transport& tr, const RankMap& g) {
    for (const auto& t : tensors) group_ops::allReduce(tr, g, t, op, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  auto what = opName("reduce");
  auto dt = deviceTypeOf(tensors, what);
  auto op = opts.reduceOp;
  int root = static_cast<int>(opts.rootRank);
  return launch(map_, what, dt, tensors, [tensors, op, root, what](Transport& tr, const RankMap& g) {
    for (const auto& t : tensors) group_ops::reduce(tr, g, t, op, root, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions&) {
  auto what = opName("all_gather");
  TORCH_CHECK(outputs.size() == inputs.size(), "bytescale ", what, ": ", outputs.size(),
              " output lists for ", inputs.size(), " inputs");
  auto dt = deviceTypeOf(inputs, what);
  const int n = map_->size();
  std::vector<at::Tensor> flat_outs;
  for (size_t k = 0; k < outputs.size(); ++k) {
    TORCH_CHECK(static_cast<int>(outputs[k].size()) == n, "bytescale ", what, ": output list has ",
                outputs[k].size(), " tensors for a group of ", n);
    for (const auto& o : outputs[k]) {
      TORCH_CHECK(o.numel() == inputs[k].numel(), "bytescale ", what, ": output tensor of shape ",
                  o.sizes(), " for input of shape ", inputs[k].sizes());
      flat_outs.push_back(o);
    }
  }
  return launch(map_, what, dt, flat_outs,
                [outputs, inputs, what, n](Transport& tr, const RankMap& g) {
                  for (size_t k = 0; k < inputs.size(); ++k) {
                    at::Tensor buf = at::empty({n * inputs[k].numel()}, inputs[k].options());
                    group_ops::allGather(tr, g, buf, inputs[k], what);
                    auto parts = buf.view({n, -1});
                    for (int j = 0; j < n; ++j)
                      outputs[k][j].copy_(parts[j].view(outputs[k][j].sizes()));
                  }
                });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) {
  auto what = opName("all_gather_into_tensor");
  auto dt = deviceTypeOf({output, input}, what);
  return launch(map_, what, dt, {output}, [output, input, what](Transport& tr, const RankMap& g) {
    group_ops::allGather(tr, g, output, input, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions&) {
  auto what = opName("all_gather_into_tensor_coalesced");
  TORCH_CHECK(outputs.size() == inputs.size(), "bytescale ", what, ": ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  auto dt = deviceTypeOf(inputs, what);
  return launch(map_, what, dt, outputs, [outputs, inputs, what](Transport& tr, const RankMap& g) {
    for (size_t k = 0; k < inputs.size(); ++k)
      group_ops::allGather(tr, g, outputs[k], inputs[k], what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  auto what = opName("gather");
  TORCH_CHECK(inputs.size() == 1, "bytescale ", what, ": expects one input tensor");
  auto dt = deviceTypeOf(inputs, what);
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  at::Tensor in = inputs[0];
  return launch(map_, what, dt, outs, [outs, in, root, what](Transport& tr, const RankMap& g) {
    group_ops::gather(tr, g, outs, in, root, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  auto what = opName("scatter");
  TORCH_CHECK(outputs.size() == 1, "bytescale ", what, ": expects one output tensor");
  auto dt = deviceTypeOf(outputs, what);
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> ins = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];
  at::Tensor out = outputs[0];
  return launch(map_, what, dt, {out}, [out, ins, root, what](Transport& tr, const RankMap& g) {
    group_ops::scatter(tr, g, out, ins, root, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto what = opName("reduce_scatter");
  TORCH_CHECK(outputs.size() == inputs.size(), "bytescale ", what, ": ", outputs.size(),
              " outputs for ", inputs.size(), " input lists");
  auto dt = deviceTypeOf(outputs, what);
  const int n = map_->size();
  for (size_t k = 0; k < inputs.size(); ++k) {
    TORCH_CHECK(static_cast<int>(inputs[k].size()) == n, "bytescale ", what, ": input list has ",
                inputs[k].size(), " tensors for a group of ", n);
    for (const auto& t : inputs[k])
      TORCH_CHECK(t.numel() == outputs[k].numel(), "bytescale ", what, ": input tensor of shape ",
                  t.sizes(), " for output of shape ", outputs[k].sizes());
  }
  auto op = opts.reduceOp;
  return launch(map_, what, dt, outputs,
                [outputs, inputs, op, what](Transport& tr, const RankMap& g) {
                  for (size_t k = 0; k < outputs.size(); ++k) {
                    std::vector<at::Tensor> flat;
                    for (const auto& t : inputs[k]) flat.push_back(t.reshape(-1));
                    group_ops::reduceScatter(tr, g, outputs[k], at::cat(flat), op, what);
                  }
                });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  auto what = opName("reduce_scatter_tensor");
  auto dt = deviceTypeOf({output, input}, what);
  auto op = opts.reduceOp;
  group_ops::checkReduceOp(op, input, what);
  return launch(map_, what, dt, {output}, [output, input, op, what](Transport& tr, const RankMap& g) {
    group_ops::reduceScatter(tr, g, output, input, op, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto what = opName("reduce_scatter_tensor_coalesced");
  TORCH_CHECK(outputs.size() == inputs.size(), "bytescale ", what, ": ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  auto dt = deviceTypeOf(inputs, what);
  auto op = opts.reduceOp;
  return launch(map_, what, dt, outputs,
                [outputs, inputs, op, what](Transport& tr, const RankMap& g) {
                  for (size_t k = 0; k < inputs.size(); ++k)
                    group_ops::reduceScatter(tr, g, outputs[k], inputs[k], op, what);
                });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions&) {
  auto what = opName("all_to_all_single");
  auto dt = deviceTypeOf({output, input}, what);
  return launch(map_, what, dt, {output},
                [output, input, output_splits, input_splits, what](Transport& tr,
                                                                   const RankMap& g) {
                  group_ops::allToAll(tr, g, output, input, output_splits, input_splits, what);
                });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions&) {
  auto what = opName("all_to_all");
  const int n = map_->size();
  TORCH_CHECK(static_cast<int>(outputs.size()) == n && static_cast<int>(inputs.size()) == n,
              "bytescale ", what, ": needs ", n, " input and output tensors, got ", inputs.size(),
              " and ", outputs.size());
  auto dt = deviceTypeOf(inputs, what);
  return launch(map_, what, dt, outputs, [outputs, inputs, what](Transport& tr, const RankMap& g) {
    group_ops::allToAllList(tr, g, outputs, inputs, what);
  });
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::p2p(P2POp::Kind kind,
                                                        std::vector<at::Tensor>& tensors, int peer,
                                                        const char* op) {
  auto what = opName(op);
  map_->requireMember(what);
  TORCH_CHECK(tensors.size() == 1, "bytescale ", what, ": expects exactly one tensor");
  auto dt = deviceTypeOf(tensors, what);
  TORCH_CHECK(tensors[0].is_contiguous(), "bytescale ", what, ": the tensor must be contiguous");
  int global = map_->globalRank(peer);
  P2POp p{kind, global, tensors[0]};
  {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    if (coalescer_.active()) {
      coalescer_.add(dt, p);
      return completedWork(getRank(), c10d::OpType::UNKNOWN, tensors);
    }
  }
  auto tr = requireTransport(dt, what);
  return c10::make_intrusive<ExchangeWork>(
      getRank(), kind == P2POp::kSend ? c10d::OpType::SEND : c10d::OpType::RECV,
      tr->exchange({p}, what), tensors);
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::send(std::vector<at::Tensor>& tensors,
                                                         int dst_rank, int) {
  return p2p(P2POp::kSend, tensors, dst_rank, "send");
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::recv(std::vector<at::Tensor>& tensors,
                                                         int src_rank, int) {
  return p2p(P2POp::kRecv, tensors, src_rank, "recv");
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::barrier(const c10d::BarrierOptions&) {
  auto what = opName("barrier");
  return launch(map_, what, c10::DeviceType::CPU, {}, [what](Transport& tr, const RankMap& g) {
    group_ops::barrier(tr, g, what);
  });
}

void DynamicGroupBackend::startCoalescing() {
  std::lock_guard<std::mutex> g(coalesce_mu_);
  coalescer_.start(opName("coalescing"));
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::endCoalescing() {
  std::lock_guard<std::mutex> g(coalesce_mu_);
  return coalescer_.end(getRank(), opName("coalescing"));
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::ringExchange(const at::Tensor& send,
                                                                 const at::Tensor& recv) {
  auto what = opName("ring_exchange");
  map_->requireMember(what);
  std::vector<at::Tensor> ts;
  if (send.defined()) ts.push_back(send);
  if (recv.defined()) ts.push_back(recv);
  if (ts.empty() || map_->size() == 1) {
    if (map_->size() == 1 && send.defined() && recv.defined()) recv.copy_(send);
    return completedWork(getRank(), c10d::OpType::UNKNOWN, ts);
  }
  auto dt = deviceTypeOf(ts, what);
  if (send.defined() && recv.defined())
    TORCH_CHECK(send.scalar_type() == recv.scalar_type(), "bytescale ", what,
                ": send dtype ", send.scalar_type(), " != recv dtype ", recv.scalar_type());
  auto tr = requireTransport(dt, what);
  return c10::make_intrusive<ExchangeWork>(
      getRank(), c10d::OpType::UNKNOWN,
      tr->ringStep(send, map_->next(), recv, map_->prev(), what), ts);
}

}  // namespace comm
}  // namespace bytescale
