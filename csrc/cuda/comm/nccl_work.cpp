#include "cuda/comm/nccl_work.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <thread>

namespace bytescale {
namespace cuda {

NcclWork::NcclWork(int rank, comm::WorkInfo info, c10::Device device,
                   std::vector<at::Tensor> outputs, std::shared_ptr<NcclComm> comm, bool cpu_sync)
    : comm::Work(rank, std::move(info), std::move(outputs), {device}),
      device_(device),
      comm_(std::move(comm)),
      cpu_sync_(cpu_sync),
      start_(std::chrono::steady_clock::now()) {}

void NcclWork::recordEnd(const c10::cuda::CUDAStream& comm_stream) {
  end_.record(comm_stream);
  // A CUDA-aware future: its value is ready on the communication stream (DDP's hook reads it).
  future_->markCompleted(c10::IValue(outputs_));
}

void NcclWork::checkAborted() const {
  if (!comm_->aborted()) return;
  TORCH_CHECK_WITH(DistBackendError, false, "bytescale ", info_.what,
                   ": the NCCL communicator was aborted (", comm_->abortReason(), ")");
}

bool NcclWork::poll() {
  if (c10d::Work::isCompleted()) return true;
  if (!end_.query()) return false;
  complete();
  return true;
}

bool NcclWork::isCompleted() {
  if (comm_->aborted() && !c10d::Work::isCompleted()) fail(comm_->abortReason());
  return poll();
}

void NcclWork::fail(const std::string& reason) {
  complete(std::make_exception_ptr(c10::DistBackendError(
      {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
      "bytescale " + info_.what + ": the NCCL communicator was aborted (" + reason + ")")));
}

std::string NcclWork::timeoutMessage(std::chrono::milliseconds limit) const {
  std::ostringstream os;
  os << info_.what << " did not complete within " << limit.count()
     << " ms (the process group's timeout)";
  std::vector<int> peers = info_.peers;
  if (peers.empty() && info_.group)
    for (int r : info_.group->ranks())
      if (r != rank_) peers.push_back(r);
  if (!peers.empty()) {
    os << "; waiting for rank" << (peers.size() == 1 ? " " : "s ");
    for (size_t i = 0; i < peers.size() && i < 16; ++i) os << (i ? ", " : "") << peers[i];
    if (peers.size() > 16) os << ", ...";
  }
  return os.str();
}

void NcclWork::synchronize() {
  c10::cuda::CUDAGuard g(device_);
  end_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
}

bool NcclWork::wait(std::chrono::milliseconds timeout) {
  checkAborted();
  synchronize();  // GPU-side wait: the caller's current stream waits on the end event
  if (timeout != kNoTimeout || cpu_sync_) {
    const auto limit = limitFor(timeout);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    auto nap = std::chrono::microseconds(50);
    while (!poll()) {
      checkAborted();
      if (limit > std::chrono::milliseconds(0) && std::chrono::steady_clock::now() >= deadline)
        throwTimeout(limit, timeout != kNoTimeout);
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(5000));
    }
  }
  checkAborted();
  return true;
}

}  // namespace cuda
}  // namespace bytescale
