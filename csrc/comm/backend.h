// The "bytescale" torch.distributed backend for the world group: the executor behind the front end
// (front_end.h) for the world.
//
//   CPU tensors:  Gloo (a torch ProcessGroupGloo handed in from Python) for the collectives it does
//                 natively; bytescale's P2P algorithms (group_ops) over the GlooTransport for what
//                 Gloo lacks (AVG / PREMUL_SUM reductions, reduce-scatter, list all-to-all, ...).
//   CUDA tensors: the device plug-in registered for CUDA (device_backends.h; the NCCL backend of
//                 csrc/cuda/comm/ when built with CUDA), one communicator for the whole world.
//
// It registers its transports as the process's world transports, so dynamic groups and ring
// attention run on the same communicators.
#pragma once

#include <atomic>
#include <map>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/device_backends.h"
#include "comm/front_end.h"
#include "comm/gloo_transport.h"

namespace bytescale {
namespace comm {

class BytescaleBackend final : public CollectiveBackend {
 public:
  BytescaleBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> gloo);
  ~BytescaleBackend() override;

  const std::string getBackendName() const override { return "bytescale"; }

  c10::intrusive_ptr<c10d::Work> execute(Collective c) override;
  std::shared_ptr<Transport> p2pTransport(c10::DeviceType device,
                                          const std::string& what) override;

  void eagerConnectSingleDevice(at::Device device) override;
  void shutdown() override;
  void abort() override;

  std::shared_ptr<Transport> transport(c10::DeviceType device) const;
  // Whether the device plug-in's world communicator exists (false without a plug-in).
  bool deviceConnected(c10::DeviceType device) const;

 protected:
  void checkOpen(const std::string& what) const override;
  c10::intrusive_ptr<c10d::Work> postRecvAnysource(const at::Tensor& tensor, int tag,
                                                   WorkInfo info) override;

 private:
  // The plug-in of a non-CPU device type (raises naming what is missing).
  const DeviceBackend& plugin(c10::DeviceType device, const std::string& what) const;
  c10::intrusive_ptr<c10d::Work> executeOnCpu(Collective c);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::shared_ptr<GlooTransport> cpu_;
  std::map<c10::DeviceType, DeviceBackend> plugins_;  // fixed after construction
  std::atomic<bool> shut_down_{false};
};

}  // namespace comm
}  // namespace bytescale
