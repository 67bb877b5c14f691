#include "offload/offload.h"

#include <ATen/ATen.h>

#include <sstream>

#ifdef BYTESCALE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bytescale {
namespace offload {

// ---- HostPool ------------------------------------------------------------------------------------

int64_t HostPool::bucket(int64_t bytes) {
  // Round up to a power of two at or above 4 KiB so buffers of similar sizes are reused.
  int64_t b = 4096;
  while (b < bytes) b <<= 1;
  return b;
}

at::Tensor HostPool::acquire(int64_t bytes, bool pinned) {
  const int64_t b = bucket(std::max<int64_t>(bytes, 1));
  std::lock_guard<std::mutex> g(mu_);
  auto it = free_.find({b, pinned});
  at::Tensor buf;
  if (it != free_.end()) {
    buf = it->second;
    free_.erase(it);
  } else {
    if (limit_ > 0 && reserved_ + b > limit_) {
      // Give back cached buffers of other sizes before failing.
      for (auto f = free_.begin(); f != free_.end() && reserved_ + b > limit_;) {
        reserved_ -= f->first.first;
        f = free_.erase(f);
      }
      TORCH_CHECK(reserved_ + b <= limit_, "bytescale offload: the host pool cannot hold ", bytes,
                  " more bytes (", b, " bucket): ", reserved_, " of its ", limit_,
                  "-byte limit are reserved (", in_use_, " in use)");
    }
    auto opts = at::TensorOptions().dtype(at::kByte).pinned_memory(pinned);
    buf = at::empty({b}, opts);
    reserved_ += b;
  }
  in_use_ += b;
  peak_ = std::max(peak_, in_use_);
  return buf;
}

void HostPool::release(at::Tensor buf) {
  if (!buf.defined()) return;
  const int64_t b = buf.numel();
  std::lock_guard<std::mutex> g(mu_);
  in_use_ -= b;
  free_.emplace(std::make_pair(b, buf.is_pinned()), std::move(buf));
}

int64_t HostPool::reservedBytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return reserved_;
}
int64_t HostPool::inUseBytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return in_use_;
}
int64_t HostPool::peakInUseBytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return peak_;
}
void HostPool::clear() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& f : free_) reserved_ -= f.first.first;
  free_.clear();
}

// ---- Engine ----------------------------------------------------------------------------------------

struct Engine::Entry {
  at::Tensor host;      // pool buffer (bytes)
  at::Tensor host_view; // host rows, typed and shaped
  at::Tensor kept;      // rows [n_off, rows) left on the device
  at::Tensor restored;  // rows [0, n_off) back on the device
  int64_t n_off = 0, rows = 0;
  std::mutex m;
  std::condition_variable cv;
  bool to_host_done = false, to_dev_started = false, to_dev_done = false;
  std::exception_ptr err;
  bool cuda = false;
  int device = -1;
#ifdef BYTESCALE_WITH_CUDA
  cudaEvent_t d2h_done = nullptr, h2d_done = nullptr;
  ~Entry() {
    if (d2h_done) cudaEventDestroy(d2h_done);
    if (h2d_done) cudaEventDestroy(h2d_done);
  }
#endif
};

#ifdef BYTESCALE_WITH_CUDA
// ---- CUDA path: pinned pool buffers, a D2H and an H2D stream per device, events for every
// dependency, no host synchronisation. Run on one H200 (tests/test_offload.py, 2026-11-22).
namespace {
void cudaCheck(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "bytescale offload: ", what, ": ", cudaGetErrorString(e));
}
cudaEvent_t recordOn(const c10::cuda::CUDAStream& s) {
  cudaEvent_t ev;
  cudaCheck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event create");
  cudaCheck(cudaEventRecord(ev, s.stream()), "event record");
  return ev;
}
void streamWait(const c10::cuda::CUDAStream& s, cudaEvent_t ev) {
  cudaCheck(cudaStreamWaitEvent(s.stream(), ev, 0), "stream wait");
}
struct CudaStreams {
  std::mutex mu;
  std::map<int, std::pair<c10::cuda::CUDAStream, c10::cuda::CUDAStream>> by_device;
  std::pair<c10::cuda::CUDAStream, c10::cuda::CUDAStream> get(c10::DeviceIndex d) {
    std::lock_guard<std::mutex> g(mu);
    auto it = by_device.find(d);
    if (it == by_device.end())
      it = by_device.emplace(d, std::make_pair(c10::cuda::getStreamFromPool(false, d),
                                               c10::cuda::getStreamFromPool(false, d))).first;
    return it->second;
  }
};
// Process-lifetime singletons, deliberately never destroyed: their destructors would run at exit
// after torch's CUDA state (stream pools, host allocator) is gone, and freeing a pinned tensor
// then aborts the process ("Unrecognized stream", seen on an H200 2026-11-22).
CudaStreams& streams() {
  static auto* s = new CudaStreams();
  return *s;
}
// Host buffers still read by an in-flight H2D copy return to the pool once its event completed.
struct Deferred {
  std::mutex mu;
  std::vector<std::pair<cudaEvent_t, at::Tensor>> items;
};
Deferred& deferred() {
  static auto* d = new Deferred();
  return *d;
}
void drainDeferred(HostPool& pool) {
  std::lock_guard<std::mutex> g(deferred().mu);
  auto& v = deferred().items;
  for (size_t i = 0; i < v.size();) {
    cudaError_t q = cudaEventQuery(v[i].first);
    if (q == cudaSuccess) {
      cudaEventDestroy(v[i].first);
      pool.release(std::move(v[i].second));
      v[i] = std::move(v.back());
      v.pop_back();
    } else {
      if (q == cudaErrorNotReady) (void)cudaGetLastError();
      ++i;
    }
  }
}
}  // namespace
#endif

Engine::Engine(int64_t pool_limit_bytes) : pool_(pool_limit_bytes) {
  worker_ = std::thread([this] {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(q_mu_);
        q_cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        job = std::move(q_.front());
        q_.pop_front();
      }
      job();
    }
  });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Engine::runOnWorker(std::function<void()> fn, std::shared_ptr<Entry> e, bool to_host) {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    q_.push_back([fn = std::move(fn), e, to_host] {
      std::exception_ptr err;
      try {
        fn();
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> g(e->m);
        if (err && !e->err) e->err = err;
        (to_host ? e->to_host_done : e->to_dev_done) = true;
      }
      e->cv.notify_all();
    });
  }
  q_cv_.notify_one();
}

void Engine::waitStage(Entry& e, bool to_host) {
  std::unique_lock<std::mutex> lk(e.m);
  e.cv.wait(lk, [&] { return to_host ? e.to_host_done : e.to_dev_done; });
  if (e.err) std::rethrow_exception(e.err);
}

int64_t Engine::offload(const at::Tensor& t, double ratio) {
  TORCH_CHECK(ratio >= 0.0 && ratio <= 1.0, "bytescale offload: ratio ", ratio, " outside [0, 1]");
  TORCH_CHECK(t.dim() >= 1, "bytescale offload: tensors need a sequence dimension, got a scalar");
#ifndef BYTESCALE_WITH_CUDA
  TORCH_CHECK(t.device().is_cpu(), "bytescale offload: ", t.device(),
              " tensors need bytescale built with CUDA");
#else
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "bytescale offload: unsupported device ",
              t.device());
  drainDeferred(pool_);
#endif
  auto e = std::make_shared<Entry>();
  e->rows = t.size(0);
  e->n_off = std::min<int64_t>(e->rows, static_cast<int64_t>(std::llround(ratio * e->rows)));
  at::Tensor src = t.contiguous();
  const int64_t row_elems = e->rows ? src.numel() / e->rows : 0;
  const int64_t bytes = e->n_off * row_elems * src.element_size();
  e->cuda = t.device().is_cuda();
  e->device = e->cuda ? t.device().index() : -1;
  e->host = pool_.acquire(bytes, /*pinned=*/e->cuda);
  std::vector<int64_t> shape(src.sizes().begin(), src.sizes().end());
  shape[0] = e->n_off;
  e->host_view = e->host.narrow(0, 0, bytes).view(src.scalar_type()).view(shape);
  if (e->n_off < e->rows) e->kept = src.narrow(0, e->n_off, e->rows - e->n_off).clone();
  at::Tensor head = src.narrow(0, 0, e->n_off);
  at::Tensor dst = e->host_view;
  if (e->cuda) {
#ifdef BYTESCALE_WITH_CUDA
    const auto dev = src.device().index();
    c10::cuda::CUDAGuard guard(dev);
    auto [d2h, h2d] = streams().get(dev);
    (void)h2d;
    cudaEvent_t ready = recordOn(c10::cuda::getCurrentCUDAStream(dev));
    streamWait(d2h, ready);
    cudaEventDestroy(ready);
    {
      c10::cuda::CUDAStreamGuard sg(d2h);
      dst.copy_(head, /*non_blocking=*/true);
    }
    // head's memory may be freed by its owner now: the allocator waits for the D2H stream.
    c10::cuda::CUDACachingAllocator::recordStream(head.storage().data_ptr(), d2h);
    e->d2h_done = recordOn(d2h);
    e->to_host_done = true;  // ordering is carried by the event from here on
#endif
  } else {
    runOnWorker([dst, head]() mutable { dst.copy_(head); }, e, /*to_host=*/true);
  }
  std::lock_guard<std::mutex> g(mu_);
  const int64_t h = next_++;
  entries_[h] = e;
  offloaded_bytes_ += bytes;
  return h;
}

void Engine::prefetch(int64_t handle) {
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = entries_.find(handle);
    TORCH_CHECK(it != entries_.end(), "bytescale offload: unknown handle ", handle);
    e = it->second;
  }
  {
    std::lock_guard<std::mutex> g(e->m);
    if (e->to_dev_started) return;
    e->to_dev_started = true;
  }
  if (e->cuda) {
#ifdef BYTESCALE_WITH_CUDA
    const auto dev = static_cast<c10::DeviceIndex>(e->device);
    c10::cuda::CUDAGuard guard(dev);
    auto [d2h, h2d] = streams().get(dev);
    (void)d2h;
    streamWait(h2d, e->d2h_done);
    {
      c10::cuda::CUDAStreamGuard sg(h2d);
      e->restored = at::empty(e->host_view.sizes(),
                              e->host_view.options().device(c10::Device(c10::DeviceType::CUDA, dev)).pinned_memory(false));
      e->restored.copy_(e->host_view, /*non_blocking=*/true);
    }
    e->h2d_done = recordOn(h2d);
    std::lock_guard<std::mutex> g(e->m);
    e->to_dev_done = true;
#endif
    return;
  }
  // The worker runs jobs in order, so the copy back starts after the copy out finished.
  auto ep = e.get();
  runOnWorker([ep]() { ep->restored = ep->host_view.clone(); }, e, /*to_host=*/false);
}

at::Tensor Engine::fetch(int64_t handle) {
  prefetch(handle);
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> g(mu_);
    e = entries_.at(handle);
    entries_.erase(handle);
  }
  waitStage(*e, /*to_host=*/true);
  waitStage(*e, /*to_host=*/false);
#ifdef BYTESCALE_WITH_CUDA
  if (e->cuda) {
    const auto dev = e->restored.device().index();
    c10::cuda::CUDAGuard guard(dev);
    auto cur = c10::cuda::getCurrentCUDAStream(dev);
    streamWait(cur, e->h2d_done);  // GPU-side: the consumer's stream waits for the H2D copy
    c10::cuda::CUDACachingAllocator::recordStream(e->restored.storage().data_ptr(), cur);
    at::Tensor out = e->kept.defined() ? (e->n_off ? at::cat({e->restored, e->kept}, 0) : e->kept)
                                       : e->restored;
    // The pinned buffer is reusable once the H2D copy finished: hand it back lazily.
    cudaEvent_t done;
    cudaCheck(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event create");
    cudaCheck(cudaEventRecord(done, streams().get(dev).second.stream()), "event record");
    {
      std::lock_guard<std::mutex> g(deferred().mu);
      deferred().items.emplace_back(done, std::move(e->host));
    }
    return out;
  }
#endif
  at::Tensor out = e->kept.defined() ? (e->n_off ? at::cat({e->restored, e->kept}, 0) : e->kept)
                                     : e->restored;
  pool_.release(std::move(e->host));
  return out;
}

void Engine::discard(int64_t handle) {
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = entries_.find(handle);
    if (it == entries_.end()) return;
    e = it->second;
    entries_.erase(it);
  }
  waitStage(*e, /*to_host=*/true);
  {
    std::unique_lock<std::mutex> lk(e->m);
    if (e->to_dev_started) e->cv.wait(lk, [&] { return e->to_dev_done; });
  }
#ifdef BYTESCALE_WITH_CUDA
  // Rare path: make sure no copy still touches the pinned buffer before it is reused.
  if (e->d2h_done) cudaEventSynchronize(e->d2h_done);
  if (e->h2d_done) cudaEventSynchronize(e->h2d_done);
#endif
  pool_.release(std::move(e->host));
}

int64_t Engine::pending() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>(entries_.size());
}

}  // namespace offload
}  // namespace bytescale
