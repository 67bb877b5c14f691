// The CUDA copy engine of the offload subsystem (csrc/offload/copy_engine.h), registered for CUDA
// tensors when the extension loads. Host buffers are pinned; the copy out runs on a D2H stream and
// the copy back on an H2D stream (one pair per device and engine), each ordered by events: the D2H
// stream waits for the producer's current stream, the H2D stream for the copy out and for the
// consumer's stream at the restored tensor's allocation, the consumer's current stream for the
// copy back. The restored tensor is allocated on the CONSUMER's stream (the caller's current
// stream at prefetch), so the caching allocator serves and reuses it from the pool the backward's
// own activations use; the H2D stream only writes it (recordStream). Nothing blocks the host on
// the hot path; a host buffer returns to the pool once the copy back's event completed (Engine
// polls hostIdle()).
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "offload/copy_engine.h"

namespace bytescale {
namespace cuda {

namespace {

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "bytescale offload: ", what, ": ", cudaGetErrorString(e));
}

// An event recorded on a stream now (owned: destroyed with the object).
class Event {
 public:
  explicit Event(const c10::cuda::CUDAStream& s) {
    check(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), "event create");
    check(cudaEventRecord(ev_, s.stream()), "event record");
  }
  ~Event() { (void)cudaEventDestroy(ev_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void blockStream(const c10::cuda::CUDAStream& s) const {
    check(cudaStreamWaitEvent(s.stream(), ev_, 0), "stream wait");
  }
  bool done() const {
    const cudaError_t q = cudaEventQuery(ev_);
    if (q == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check(q, "event query");
    return true;
  }
  void synchronize() const { check(cudaEventSynchronize(ev_), "event synchronize"); }

 private:
  cudaEvent_t ev_ = nullptr;
};

struct Streams {
  c10::cuda::CUDAStream d2h, h2d;
};

class CudaTransfer final : public offload::Transfer {
 public:
  CudaTransfer(Streams streams, const at::Tensor& src, const at::Tensor& host)
      : streams_(streams), device_(src.device()), host_(host) {
    const c10::cuda::CUDAGuard guard(device_);
    Event(c10::cuda::getCurrentCUDAStream(device_.index())).blockStream(streams_.d2h);
    {
      const c10::cuda::CUDAStreamGuard sg(streams_.d2h);
      host_.copy_(src, /*non_blocking=*/true);
    }
    // src's memory may be freed by its owner now: the allocator waits for the D2H stream.
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), streams_.d2h);
    d2h_done_ = std::make_unique<Event>(streams_.d2h);
  }

  void toDevice() override {
    const c10::cuda::CUDAGuard guard(device_);
    const auto consumer = c10::cuda::getCurrentCUDAStream(device_.index());
    alloc_stream_ = consumer.id();
    // Allocated on the consumer's stream (no stream guard): the block may have been freed by work
    // still queued there, so the H2D stream waits for that work before writing it.
    restored_ = at::empty_strided(host_.sizes(), host_.strides(),
                                  host_.options().device(device_).pinned_memory(false));
    Event(consumer).blockStream(streams_.h2d);
    d2h_done_->blockStream(streams_.h2d);
    {
      const c10::cuda::CUDAStreamGuard sg(streams_.h2d);
      restored_.copy_(host_, /*non_blocking=*/true);
    }
    // If the tensor dies before its consumer waits, the allocator still waits for the copy back.
    c10::cuda::CUDACachingAllocator::recordStream(restored_.storage().data_ptr(), streams_.h2d);
    h2d_done_ = std::make_unique<Event>(streams_.h2d);
  }

  at::Tensor restored() override {
    TORCH_CHECK(h2d_done_, "bytescale offload: internal error, restored() before toDevice()");
    const c10::cuda::CUDAGuard guard(device_);
    auto cur = c10::cuda::getCurrentCUDAStream(device_.index());
    h2d_done_->blockStream(cur);  // GPU-side: the consumer's stream waits for the copy back
    if (cur.id() != alloc_stream_)  // used on a stream other than the one it was allocated on
      c10::cuda::CUDACachingAllocator::recordStream(restored_.storage().data_ptr(), cur);
    return restored_;
  }

  // The copy back waited for the copy out, so its event covers both.
  bool hostIdle() override { return (h2d_done_ ? h2d_done_ : d2h_done_)->done(); }
  void waitHostIdle() override { (h2d_done_ ? h2d_done_ : d2h_done_)->synchronize(); }

 private:
  Streams streams_;
  c10::Device device_;
  at::Tensor host_, restored_;
  c10::StreamId alloc_stream_ = 0;
  std::unique_ptr<Event> d2h_done_, h2d_done_;
};

class CudaCopyEngine final : public offload::CopyEngine {
 public:
  bool pinnedHost() const override { return true; }

  std::unique_ptr<offload::Transfer> toHost(const at::Tensor& src, const at::Tensor& host) override {
    return std::make_unique<CudaTransfer>(streamsFor(src.device().index()), src, host);
  }

 private:
  Streams streamsFor(c10::DeviceIndex d) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = streams_.find(d);
    if (it == streams_.end())
      it = streams_.emplace(d, Streams{c10::cuda::getStreamFromPool(false, d),
                                       c10::cuda::getStreamFromPool(false, d)}).first;
    return it->second;
  }

  std::mutex mu_;
  std::map<c10::DeviceIndex, Streams> streams_;
};

[[maybe_unused]] const bool registered = [] {
  offload::registerCopyEngine(c10::DeviceType::CUDA, [] { return std::make_unique<CudaCopyEngine>(); });
  return true;
}();

}  // namespace

}  // namespace cuda
}  // namespace bytescale
