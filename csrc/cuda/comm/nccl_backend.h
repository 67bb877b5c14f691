// The CUDA plug-in of the comm subsystem: NCCL as the executor behind the collective front end
// (comm/front_end.h), on ONE world communicator (nccl_transport.h). BytescaleBackend hands it the
// world's CUDA collectives; it registers itself with comm/device_backends.h when the extension is
// loaded (built only with CUDA).
//
// Semantics:
//   * The communicator is created on the first world collective (every rank calls those) or by
//     eagerConnectSingleDevice (init_process_group(..., device_id=...)). Point-to-point and
//     dynamic-group ops before that raise an error (creating it lazily from a subset of ranks
//     would deadlock), except on a communicator of two ranks (a pipeline channel's static group),
//     which its first point-to-point op creates (both ranks take part in every one).
//   * Works, streams and the watchdog: nccl_work.h, nccl_transport.h, nccl_watchdog.h.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/device_backends.h"
#include "comm/front_end.h"
#include "cuda/comm/nccl_transport.h"

namespace bytescale {
namespace cuda {

class NcclBackend final : public comm::CollectiveBackend {
 public:
  // comm: an existing (split) communicator; default: one created on the first collective.
  NcclBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
              std::chrono::milliseconds timeout, std::shared_ptr<NcclComm> comm = nullptr);
  ~NcclBackend() override;

  const std::string getBackendName() const override { return "bytescale-nccl"; }

  c10::intrusive_ptr<c10d::Work> execute(comm::Collective c) override;
  std::shared_ptr<comm::Transport> p2pTransport(c10::DeviceType device,
                                                const std::string& what) override;

  void eagerConnectSingleDevice(at::Device device) override;
  void shutdown() override;
  void abort() override;

  const std::shared_ptr<NcclTransport>& transport() const { return transport_; }

  // The plug-in of a static group split from this backend's communicator (comm/device_backends.h
  // DeviceBackendSplit); a parent not connected yet gives the group a communicator of its own,
  // created on its first collective.
  comm::DeviceBackend split(const comm::DeviceBackendOptions& group, int color, int key);

 private:
  std::shared_ptr<NcclTransport> transport_;
};

// The NCCL calls of one validated collective on the world communicator (nccl_collectives.cpp).
// rank: this rank; n: the world size. Runs with the communication stream current.
void enqueueCollective(const comm::Collective& c, int rank, int n, ncclComm_t comm,
                       cudaStream_t stream);

}  // namespace cuda
}  // namespace bytescale
