// The NCCL calls of each collective kind (comm/collective.h) on the world communicator. The
// front end validated the call; these functions only enqueue, on the communication stream.
#include <ATen/ATen.h>

#include "cuda/comm/nccl_backend.h"

namespace bytescale {
namespace cuda {

namespace {

using comm::Collective;
using comm::CollectiveKind;

void* bytes(const at::Tensor& t, int64_t element_offset) {
  return static_cast<char*>(t.data_ptr()) + element_offset * t.element_size();
}

void allReduce(const Collective& c, ncclComm_t comm, cudaStream_t s) {
  std::vector<std::unique_ptr<NcclRedOp>> ops;  // destroyed after the group ends
  NcclGroup group(c.what);
  for (const auto& t : c.inputs) {
    ops.push_back(std::make_unique<NcclRedOp>(c.op, t, comm, c.what));
    BYTESCALE_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                       ncclType(t.scalar_type(), c.what), ops.back()->get(), comm,
                                       s),
                         c.what);
  }
  group.end();
}

void reduce(const Collective& c, ncclComm_t comm, cudaStream_t s) {
  std::vector<std::unique_ptr<NcclRedOp>> ops;
  NcclGroup group(c.what);
  for (const auto& t : c.inputs) {
    ops.push_back(std::make_unique<NcclRedOp>(c.op, t, comm, c.what));
    BYTESCALE_NCCL_CHECK(ncclReduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                    ncclType(t.scalar_type(), c.what), ops.back()->get(), c.root,
                                    comm, s),
                         c.what);
  }
  group.end();
}

void broadcast(const Collective& c, ncclComm_t comm, cudaStream_t s) {
  NcclGroup group(c.what);
  for (const auto& t : c.inputs)
    BYTESCALE_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(),
                                       ncclType(t.scalar_type(), c.what), c.root, comm, s),
                         c.what);
  group.end();
}

void allGatherInto(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins,
                   const std::string& what, ncclComm_t comm, cudaStream_t s) {
  NcclGroup group(what);
  for (size_t k = 0; k < ins.size(); ++k)
    BYTESCALE_NCCL_CHECK(ncclAllGather(ins[k].data_ptr(), outs[k].data_ptr(), ins[k].numel(),
                                       ncclType(ins[k].scalar_type(), what), comm, s),
                         what);
  group.end();
}

void reduceScatterFrom(const Collective& c, const std::vector<at::Tensor>& ins, ncclComm_t comm,
                       cudaStream_t s) {
  std::vector<std::unique_ptr<NcclRedOp>> ops;
  NcclGroup group(c.what);
  for (size_t k = 0; k < c.outputs.size(); ++k) {
    const at::Tensor& out = c.outputs[k];
    ops.push_back(std::make_unique<NcclRedOp>(c.op, out, comm, c.what));
    BYTESCALE_NCCL_CHECK(ncclReduceScatter(ins[k].data_ptr(), out.data_ptr(), out.numel(),
                                           ncclType(out.scalar_type(), c.what),
                                           ops.back()->get(), comm, s),
                         c.what);
  }
  group.end();
}

void allToAll(const Collective& c, int n, ncclComm_t comm, cudaStream_t s) {
  const at::Tensor& in = c.inputs[0];
  const at::Tensor& out = c.outputs[0];
  const int64_t row_in = in.size(0) ? in.numel() / in.size(0) : 0;
  const int64_t row_out = out.size(0) ? out.numel() / out.size(0) : 0;
  const auto dt = ncclType(in.scalar_type(), c.what);
  int64_t io = 0, oo = 0;
  NcclGroup group(c.what);
  for (int j = 0; j < n; ++j) {
    if (c.in_splits[j])
      BYTESCALE_NCCL_CHECK(ncclSend(bytes(in, io * row_in), c.in_splits[j] * row_in, dt, j, comm, s),
                           c.what);
    if (c.out_splits[j])
      BYTESCALE_NCCL_CHECK(
          ncclRecv(bytes(out, oo * row_out), c.out_splits[j] * row_out, dt, j, comm, s), c.what);
    io += c.in_splits[j];
    oo += c.out_splits[j];
  }
  group.end();
}

}  // namespace

void enqueueCollective(const Collective& c, int rank, int n, ncclComm_t comm, cudaStream_t s) {
  // Every dtype and reduce op is checked before any NCCL group opens: an error inside an open
  // group would launch the part queued so far and leave the peers mismatched.
  checkNcclDtypes(c.inputs, c.what);
  checkNcclDtypes(c.outputs, c.what);
  if (c.hasReduceOp())
    for (const auto& t : (c.inputs.empty() ? c.outputs : c.inputs)) checkNcclReduceOp(c.op, t, c.what);
  switch (c.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kBarrier:
      return allReduce(c, comm, s);
    case CollectiveKind::kReduce:
      return reduce(c, comm, s);
    case CollectiveKind::kBroadcast:
      return broadcast(c, comm, s);
    case CollectiveKind::kAllGatherInto:
      return allGatherInto(c.outputs, c.inputs, c.what, comm, s);
    case CollectiveKind::kAllGather: {
      // Through one flat buffer per input (allocated on the comm stream), then copied out.
      std::vector<at::Tensor> bufs;
      for (const auto& in : c.inputs) bufs.push_back(at::empty({n * in.numel()}, in.options()));
      allGatherInto(bufs, c.inputs, c.what, comm, s);
      for (size_t k = 0; k < c.inputs.size(); ++k) {
        auto parts = bufs[k].view({n, -1});
        for (int j = 0; j < n; ++j) {
          const at::Tensor& o = c.outputs[k * n + j];
          o.copy_(parts[j].view(o.sizes()));
        }
      }
      return;
    }
    case CollectiveKind::kGather: {
      NcclGroup group(c.what);
      if (rank == c.root) {
        for (int j = 0; j < n; ++j)
          if (j != rank) ncclRecvTensor(c.outputs[j], j, comm, s, c.what);
      } else {
        ncclSendTensor(c.inputs[0], c.root, comm, s, c.what);
      }
      group.end();
      if (rank == c.root) c.outputs[rank].copy_(c.inputs[0].view(c.outputs[rank].sizes()));
      return;
    }
    case CollectiveKind::kScatter: {
      NcclGroup group(c.what);
      if (rank == c.root) {
        for (int j = 0; j < n; ++j)
          if (j != rank) ncclSendTensor(c.inputs[j], j, comm, s, c.what);
      } else {
        ncclRecvTensor(c.outputs[0], c.root, comm, s, c.what);
      }
      group.end();
      if (rank == c.root) c.outputs[0].copy_(c.inputs[rank].view(c.outputs[0].sizes()));
      return;
    }
    case CollectiveKind::kReduceScatterFrom:
      return reduceScatterFrom(c, c.inputs, comm, s);
    case CollectiveKind::kReduceScatter: {
      // Each output's n contributions, concatenated on the comm stream.
      std::vector<at::Tensor> flat;
      for (size_t k = 0; k < c.outputs.size(); ++k) {
        std::vector<at::Tensor> parts;
        for (int j = 0; j < n; ++j) parts.push_back(c.inputs[k * n + j].reshape(-1));
        flat.push_back(at::cat(parts));
      }
      return reduceScatterFrom(c, flat, comm, s);
    }
    case CollectiveKind::kAllToAll:
      return allToAll(c, n, comm, s);
    case CollectiveKind::kAllToAllList: {
      NcclGroup group(c.what);
      for (int j = 0; j < n; ++j) {
        ncclSendTensor(c.inputs[j], j, comm, s, c.what);
        ncclRecvTensor(c.outputs[j], j, comm, s, c.what);
      }
      group.end();
      return;
    }
  }
}

}  // namespace cuda
}  // namespace bytescale
