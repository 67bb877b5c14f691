// The one collective front end of every bytescale c10d backend.
//
// CollectiveBackend overrides c10d::Backend's entry points once: each turns its call into a
// Collective (collective.h), checks it (membership, devices, validate()) and hands it to the
// executor, execute(). Point-to-point calls become P2POps against global ranks, launched on
// p2pTransport() or buffered by the one P2P coalescer inside a coalescing block. The backends
// differ only in their executor:
//   BytescaleBackend (backend.h)      world group: Gloo natives or group_ops on CPU, the CUDA
//                                     plug-in (device_backends.h) on CUDA;
//   DynamicGroupBackend (dynamic_group.h)  group_ops on the world transports;
//   the NCCL plug-in (csrc/cuda/comm/)     NCCL calls on the world communicator.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/collective.h"
#include "comm/schedule.h"
#include "comm/transport.h"
#include "comm/work.h"

namespace bytescale {
namespace comm {

// Collects the sends/recvs issued between startCoalescing() and endCoalescing() (one batched
// launch at the end, what torch's batch_isend_irecv expects from a coalescing backend), and the
// Works of collectives issued inside the block (the block's Work completes with them).
class P2PCoalescer {
 public:
  struct Batch {
    c10::DeviceType device = c10::DeviceType::CPU;
    std::vector<P2POp> ops;
    std::vector<c10::intrusive_ptr<CoalescedOpWork>> placeholders;
    std::vector<c10::intrusive_ptr<c10d::Work>> collectives;
  };
  void start(const std::string& what);
  bool active() const { return active_; }
  // Buffers `op`; returns the Work that will follow the batch's.
  c10::intrusive_ptr<CoalescedOpWork> add(c10::DeviceType device, P2POp op, int rank,
                                          WorkInfo info);
  void addCollective(c10::intrusive_ptr<c10d::Work> work) { batch_.collectives.push_back(work); }
  // Hands the block over and leaves coalescing mode.
  Batch take(const std::string& what);

 private:
  bool active_ = false;
  bool have_device_ = false;
  Batch batch_;
};

class CollectiveBackend : public c10d::Backend {
 public:
  // group: the members (global ranks, ring order) and this process's place in it (a non-member
  // may hold the backend; every op then raises). kind: "world group", "dynamic group".
  CollectiveBackend(std::shared_ptr<const RankMap> group, const std::string& kind,
                    std::chrono::milliseconds timeout);

  const RankMap& rankMap() const { return *group_; }
  const std::shared_ptr<const RankMap>& rankMapPtr() const { return group_; }
  const std::string& groupName() const { return group_name_; }  // "dynamic group [0, 2]"
  std::chrono::milliseconds timeout() const { return timeout_; }

  // ---- the executor ------------------------------------------------------------------------
  // Runs a collective the front end built and validated (c.what, c.device, c.timeout set).
  virtual c10::intrusive_ptr<c10d::Work> execute(Collective c) = 0;
  // The transport point-to-point ops on `device` run on (raises naming `what` if none).
  virtual std::shared_ptr<Transport> p2pTransport(c10::DeviceType device,
                                                  const std::string& what) = 0;

  // ---- c10d entry points (written once, here) -------------------------------------------------
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) final;
  // Sparse COO CPU tensors (also reached through allreduce()): SUM only, as in Gloo.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) final;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) final;
  // special_ops::monitoredBarrier on the CPU transport; opts.timeout unset: the group's timeout.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) final;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) final;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) final;
  // A receive from whichever member sends with `tag` first; the Work's sourceRank() names it.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) final;

  // Sequence numbers (ProcessGroupWrapper's desync check under TORCH_DISTRIBUTED_DEBUG=DETAIL):
  // the number of collectives this member issued on the group, so members agree while they issue
  // the same collectives. They start at 0 on every rank; the setter has nothing to agree on.
  void setSequenceNumberForGroup() final {}
  uint64_t getSequenceNumberForGroup() final { return seq_.load(); }

  bool supportsCoalescing() const final { return true; }
  void startCoalescing() final;
  c10::intrusive_ptr<c10d::Work> endCoalescing() final;

 protected:
  // The tag a user's send/recv travels with (the world keeps it; dynamic groups use bytescale's
  // own sequence tags: -1).
  virtual int p2pTag(int user_tag) const { return user_tag; }
  // Raises if the backend can no longer run operations (shut down).
  virtual void checkOpen(const std::string& what) const { (void)what; }

  std::string opName(const char* name) const { return std::string(name) + " on " + group_name_; }
  WorkInfo info(c10d::OpType type, std::string what, std::vector<int> peers = {}) const;
  WorkInfo info(const Collective& c) const;  // every other member is a peer; c.timeout
  // Posts a receive from any member (recvAnysource validated it). Default: unsupported.
  virtual c10::intrusive_ptr<c10d::Work> postRecvAnysource(const at::Tensor& tensor, int tag,
                                                           WorkInfo info);
  // Launches P2P ops (global peers) now, as one Work.
  c10::intrusive_ptr<c10d::Work> postP2P(c10::DeviceType device, const std::vector<P2POp>& ops,
                                         WorkInfo info);

 private:
  c10::intrusive_ptr<c10d::Work> submit(Collective c, std::chrono::milliseconds op_timeout);
  c10::intrusive_ptr<c10d::Work> p2p(P2POp::Kind kind, std::vector<at::Tensor>& tensors,
                                     int peer, int tag);

  std::shared_ptr<const RankMap> group_;
  std::string group_name_;
  std::chrono::milliseconds timeout_;
  std::mutex coalesce_mu_;
  P2PCoalescer coalescer_;
  std::atomic<uint64_t> seq_{0};            // collectives issued (getSequenceNumberForGroup)
  std::atomic<uint64_t> monitored_seq_{0};  // monitored barriers issued (their message tags)
};

}  // namespace comm
}  // namespace bytescale
