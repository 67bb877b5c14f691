// The "bytescale" torch.distributed backend for the world group.
//
//   CPU tensors:  Gloo (a torch ProcessGroupGloo handed in from Python) for the collectives it does
//                 natively; bytescale's P2P algorithms over the GlooTransport for what Gloo lacks
//                 (reduce-scatter with AVG / PREMUL_SUM, all-reduce with AVG / PREMUL_SUM, ...).
//   CUDA tensors: bytescale's NCCL backend (csrc/cuda/), one communicator for the whole world.
//
// It registers its transports as the process's world transports, so dynamic groups and ring
// attention run on the same communicators.
#pragma once

#include <mutex>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/dynamic_group.h"
#include "comm/gloo_transport.h"
#include "comm/schedule.h"

namespace bytescale {
namespace comm {

class BytescaleBackend final : public c10d::Backend {
 public:
  BytescaleBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> gloo);
  ~BytescaleBackend() override;

  const std::string getBackendName() const override { return "bytescale"; }

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
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
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

  void eagerConnectSingleDevice(at::Device device) override;
  void shutdown() override;
  void abort() override;

  std::chrono::milliseconds timeout() const { return timeout_; }
  std::shared_ptr<Transport> transport(c10::DeviceType device) const;

 private:
  // The native backend for the tensors' device (Gloo for CPU, NCCL for CUDA).
  c10d::Backend& native(c10::DeviceType device, const std::string& what);
  bool isCuda(c10::DeviceType d) const { return d == c10::DeviceType::CUDA; }
  // Cross-rank fingerprint check before a Gloo-native collective (CPU only; see group_ops.h).
  void check(c10::DeviceType dt, int op, const at::Tensor& t, bool shape_known, int64_t extra,
             const std::string& what);
  struct Fingerprint {
    int op;
    at::Tensor t;
    bool shape_known;
    int64_t extra;
  };
  // Runs launch() directly (CUDA, checks off, world of 1) or, for checked CPU collectives, runs
  // the cross-rank check and then launch()->wait() on the CPU transport's worker thread.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> checked(c10::DeviceType dt, const std::string& what,
                                         std::vector<Fingerprint> fps,
                                         std::vector<at::Tensor> outs, F launch);
  template <typename F>
  c10::intrusive_ptr<c10d::Work> viaGroupOps(const std::string& what, std::vector<at::Tensor> outs,
                                             F body);

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const RankMap> world_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::shared_ptr<GlooTransport> cpu_;
  c10::intrusive_ptr<c10d::Backend> nccl_;  // null without CUDA
  std::shared_ptr<Transport> cuda_;
  std::mutex coalesce_mu_;
  P2PCoalescer coalescer_;
  bool shut_down_ = false;
};

}  // namespace comm
}  // namespace bytescale
