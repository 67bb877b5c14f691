// The CUDA transport: the world NCCL communicator, its communication stream and watchdog, and the
// ProcessGroupNCCL launch pattern every CUDA operation of bytescale goes through:
//   record an event on the caller's current stream, make the comm stream wait on it, enqueue the
//   NCCL calls on the comm stream, record an end event (NcclWork); Work::wait() makes the caller's
//   current stream wait on it. The caching allocator's recordStream keeps the tensors' memory
//   from reuse until the comm stream passed the op; nothing holds the tensors themselves (they are
//   freed when the caller drops them), and the Work holds Python-free copies of its outputs.
// Dynamic groups and ring attention use it through comm::Transport; the NCCL backend
// (nccl_backend.h) launches the world's collectives with launch().
#pragma once

#include <functional>
#include <memory>

#include "comm/transport.h"
#include "cuda/comm/nccl_watchdog.h"

namespace bytescale {
namespace cuda {

class NcclTransport final : public comm::Transport {
 public:
  // comm: an existing communicator (a split one); default: one created on connect.
  NcclTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                std::chrono::milliseconds timeout, std::shared_ptr<NcclComm> comm = nullptr);
  ~NcclTransport() override;

  c10::DeviceType deviceType() const override { return c10::DeviceType::CUDA; }
  int rank() const override { return rank_; }
  int worldSize() const override { return size_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<comm::PendingExchange> exchange(const std::vector<comm::P2POp>& ops,
                                                  const std::string& what) override;
  c10::intrusive_ptr<c10d::Work> post(const std::vector<comm::P2POp>& ops,
                                      comm::WorkInfo info) override;
  c10::intrusive_ptr<c10d::Work> run(comm::WorkInfo info, std::vector<at::Tensor> outputs,
                                     std::function<void()> body,
                                     std::vector<at::Tensor> inputs = {}) override;

  using Enqueue = std::function<void(ncclComm_t, cudaStream_t)>;
  struct LaunchOptions {
    bool connect = false;   // create the communicator on the tensors' device if needed (world
                            // collectives, which every rank calls)
    bool cpu_sync = false;  // wait() also blocks the CPU (barrier)
  };
  // Enqueues `enqueue` on the comm stream after the caller's current stream; returns its Work.
  // The caller has checked that NCCL's buffers are contiguous tensors on the comm device.
  c10::intrusive_ptr<NcclWork> launch(comm::WorkInfo info, const std::vector<at::Tensor>& inputs,
                                      std::vector<at::Tensor> outputs, const Enqueue& enqueue,
                                      LaunchOptions options);

  NcclComm& comm() { return *comm_; }
  void shutdown();  // stops the watchdog, destroys the communicator; idempotent
  void abort(const std::string& reason);

 private:
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<NcclComm> comm_;
  NcclWatchdog watchdog_;
};

}  // namespace cuda
}  // namespace bytescale
