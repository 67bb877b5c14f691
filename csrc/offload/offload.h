// Selective activation offloading: a caching host-memory pool and an asynchronous copy engine.
//
// offload(t, ratio) copies the leading `ratio` share of t's first (sequence) dimension to host
// memory and keeps the rest on the device; prefetch(h) starts the copy back; fetch(h) returns the
// reassembled tensor (bit-identical to t). Copies run off the caller's thread of execution:
//   CUDA tensors: on a dedicated D2H and a dedicated H2D stream per device, ordered by events, into
//                 pinned memory, without host synchronisation on the hot path; pinned buffers go
//                 back to the pool when their H2D copy's event completes (compiled; NOT yet run on
//                 a GPU: none was lent);
//   CPU tensors:  on a copy worker thread (host-to-host), so the same bookkeeping is tested in CI.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace bytescale {
namespace offload {

// Size-bucketed cache of host buffers (pinned when the source is a CUDA tensor). Buffers return to
// the pool and are reused; `limit_bytes` (0: none) caps what the pool may reserve.
class HostPool {
 public:
  explicit HostPool(int64_t limit_bytes = 0) : limit_(limit_bytes) {}
  at::Tensor acquire(int64_t bytes, bool pinned);
  void release(at::Tensor buf);
  int64_t reservedBytes() const;
  int64_t inUseBytes() const;
  int64_t peakInUseBytes() const;
  void clear();  // drop cached (not in use) buffers

 private:
  static int64_t bucket(int64_t bytes);
  mutable std::mutex mu_;
  int64_t limit_;
  int64_t reserved_ = 0, in_use_ = 0, peak_ = 0;
  std::multimap<std::pair<int64_t, bool>, at::Tensor> free_;  // (bucket, pinned) -> buffer
};

class Engine {
 public:
  explicit Engine(int64_t pool_limit_bytes = 0);
  ~Engine();

  int64_t offload(const at::Tensor& t, double ratio);
  void prefetch(int64_t handle);
  at::Tensor fetch(int64_t handle);
  // Drop a handle without fetching (its host buffer returns to the pool).
  void discard(int64_t handle);

  HostPool& pool() { return pool_; }
  int64_t pending() const;
  int64_t offloadedBytes() const { return offloaded_bytes_; }

 private:
  struct Entry;
  void runOnWorker(std::function<void()> fn, std::shared_ptr<Entry> e, bool to_host);
  void waitStage(Entry& e, bool to_host);

  HostPool pool_;
  mutable std::mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<Entry>> entries_;
  int64_t next_ = 1;
  int64_t offloaded_bytes_ = 0;
  // CPU copy worker
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace offload
}  // namespace bytescale
