// A dynamic group: any ordered set of global ranks, created locally with no communication and no
// new communicator. Its collectives run as P2P algorithms (group_ops) on the world backend's
// transports, so any number of disjoint groups can be active at once.
#pragma once

#include <mutex>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/schedule.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {

// Collects the sends/recvs issued between startCoalescing() and endCoalescing() and launches them
// as one batched exchange (what torch's batch_isend_irecv expects from a coalescing backend).
class P2PCoalescer {
 public:
  void start(const std::string& who);
  bool active() const { return active_; }
  void add(c10::DeviceType device, P2POp op);
  c10::DeviceType device() const { return device_; }
  // Hands the buffered ops over and leaves coalescing mode.
  std::vector<P2POp> take(const std::string& who);
  // Launches the buffered ops; returns a Work (already complete if nothing was buffered).
  c10::intrusive_ptr<c10d::Work> end(int rank, const std::string& who);

 private:
  bool active_ = false;
  bool have_device_ = false;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  std::vector<P2POp> ops_;
};

std::shared_ptr<Transport> requireTransport(c10::DeviceType device, const std::string& what);
c10::DeviceType deviceTypeOf(const std::vector<at::Tensor>& tensors, const std::string& what);

class DynamicGroupBackend final : public c10d::Backend {
 public:
  // ranks: ordered global ranks; my_global_rank may be a non-member (every op then raises).
  DynamicGroupBackend(std::vector<int> ranks, int world_size, int my_global_rank);

  const std::string getBackendName() const override { return "bytescale"; }
  const RankMap& rankMap() const { return *map_; }
  std::string describe() const { return "dynamic group " + map_->describe(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Ring exchange for ring attention: send `send` to the next member and receive `recv` from the
  // previous member, as one batched step. Either tensor may be undefined.
  c10::intrusive_ptr<c10d::Work> ringExchange(const at::Tensor& send, const at::Tensor& recv);

 private:
  std::string opName(const char* op) const;
  c10::intrusive_ptr<c10d::Work> p2p(P2POp::Kind kind, std::vector<at::Tensor>& tensors, int peer,
                                     const char* op);

  std::shared_ptr<const RankMap> map_;
  std::mutex coalesce_mu_;
  P2PCoalescer coalescer_;
};

}  // namespace comm
}  // namespace bytescale
