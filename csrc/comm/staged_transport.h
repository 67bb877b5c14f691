// The staged transport: a transport for device tensors (CUDA) that copies every message through
// host memory and moves it over the world's CPU (Gloo) transport. A development and test tool,
// selected with BYTESCALE_CUDA_TRANSPORT=staged (common/env.h): NCCL refuses two ranks on one
// GPU, so without it multi-rank CUDA (ring attention with the real flash / cuDNN steps, CUDA
// dynamic-group collectives, HDP + offload) cannot run on a machine with one GPU. It is slow
// (every message crosses PCIe twice and the host synchronises with the device per message) and
// makes no attempt to overlap; its purpose is that the CUDA compute path runs multi-process.
//
//   exchange() / ringStep(): the caller's current stream is synchronised, the sends are copied to
//       pinned host buffers, the CPU transport exchanges them, wait() copies the received bytes
//       into the device tensors (on the caller's current stream, synchronously).
//   post(): the same, the device copies happening when the CPU exchange completes; its Work is
//       device-aware (its future holds device tensors).
//   agreementChannel(): the host channel of the CPU transport it runs over (the world's, or a
//       static group's own: the check of group [0, 2] pairs the group's ranks), on every device.
//   run(): body runs on the CPU transport's worker thread with the tensors' device current, after
//       the caller's current stream was synchronised; it synchronises its own stream before the
//       Work completes, so wait() returning means the results are in place.
// The same code stages CPU tensors (a plain copy), which is how tests/comm checks it on CPU.
#pragma once

#include <memory>

#include "comm/device_backends.h"
#include "comm/front_end.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {

class StagedTransport final : public Transport {
 public:
  StagedTransport(c10::DeviceType device, std::shared_ptr<Transport> cpu);

  c10::DeviceType deviceType() const override { return device_; }
  int rank() const override { return cpu_->rank(); }
  int worldSize() const override { return cpu_->worldSize(); }
  std::chrono::milliseconds timeout() const override { return cpu_->timeout(); }

  std::unique_ptr<PendingExchange> exchange(const std::vector<P2POp>& ops,
                                            const std::string& what) override;
  c10::intrusive_ptr<c10d::Work> post(const std::vector<P2POp>& ops, WorkInfo info) override;
  c10::intrusive_ptr<c10d::Work> run(WorkInfo info, std::vector<at::Tensor> outputs,
                                     std::function<void()> body,
                                     std::vector<at::Tensor> inputs = {}) override;
  // On every device (CPU tensors too, so tests/comm runs the CUDA route): a host channel.
  std::shared_ptr<Transport> agreementChannel() const override;

 private:
  c10::DeviceType device_;
  std::shared_ptr<Transport> cpu_;
  std::shared_ptr<Transport> host_;  // cpu_'s host channel (its rank space): the agreements'
};

// The world backend's plug-in for `device` on the staged transport: its collectives are the P2P
// algorithms of group_ops (as for dynamic groups) over the staged transport.
DeviceBackend makeStagedBackend(c10::DeviceType device, const DeviceBackendOptions& options);

}  // namespace comm
}  // namespace bytescale
