// The Work of the CUDA comm plug-in (after ProcessGroupNCCL's WorkNCCL): an end event recorded on
// the communication stream after the op. isCompleted() queries it (and completes the c10d Work
// once it has fired); wait() makes the caller's current stream wait on it (GPU side, the CPU does
// not block) and, with an explicit timeout (or for a barrier), also waits on the CPU up to that
// timeout, raising the bytescale timeout error naming op, group and peers. The group's timeout
// is enforced by the watchdog (nccl_watchdog.h), which aborts the communicator.
#pragma once

#include "comm/work.h"
#include "common/cuda_event.h"
#include "cuda/comm/nccl_utils.h"

namespace bytescale {
namespace cuda {

class NcclWork final : public comm::Work {
 public:
  // outputs: Python-free (common/handoff.h): the watchdog may drop the last reference.
  NcclWork(int rank, comm::WorkInfo info, c10::Device device, std::vector<at::Tensor> outputs,
           std::shared_ptr<NcclComm> comm, bool cpu_sync);

  // Launch side (comm stream current): records the end event and completes the CUDA-aware future
  // on the communication stream.
  void recordEnd(const c10::cuda::CUDAStream& comm_stream);

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;

  // ---- watchdog side ----
  // True once the end event fired (completes the Work); false while running.
  bool poll();
  // Fails the Work with `reason` (the communicator was aborted).
  void fail(const std::string& reason);
  std::chrono::steady_clock::time_point started() const { return start_; }
  // The message of a timeout found by the watchdog after `limit`.
  std::string timeoutMessage(std::chrono::milliseconds limit) const;

 private:
  void checkAborted() const;

  c10::Device device_;
  std::shared_ptr<NcclComm> comm_;
  bool cpu_sync_;
  CudaEvent end_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace cuda
}  // namespace bytescale
