// Selective activation offloading: a caching host-memory pool and an asynchronous copy engine.
//
// offload(t) copies the whole tensor t to host memory and keeps no reference to it, so t's device
// memory is freed as soon as its owner drops it (and its copy finished); prefetch(h) starts the
// copy back into a new tensor allocated for the consumer (the caller's thread on CPU, the current
// stream on CUDA) with t's sizes and strides; fetch(h) returns it, bit-identical to t. There is no
// other copy: nothing of t is cloned, nothing is concatenated. WHICH tensors go is the caller's
// choice: bytescale.offload(ratio) offloads whole saved activations until `ratio` of their bytes
// went (a split of the step's activations at pack time, not of each tensor: a tensor's storage is
// one allocation, and keeping part of it keeps all of it). The copies run off the caller's thread of
// execution, on the copy engine of the tensor's device type (copy_engine.h): a worker thread for
// CPU tensors, dedicated D2H / H2D streams and events for CUDA tensors (csrc/cuda/offload/). A host
// buffer goes back to the pool once its engine reports that no copy touches it any more.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "offload/copy_engine.h"

namespace bytescale {
namespace offload {

// Size-bucketed cache of host buffers (pinned when the copy engine asks for it). Buffers return to
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

  // t must be non-overlapping and dense (any permutation of a contiguous layout).
  int64_t offload(const at::Tensor& t);
  void prefetch(int64_t handle);
  at::Tensor fetch(int64_t handle);
  // Drop a handle without fetching (its host buffer returns to the pool).
  void discard(int64_t handle);

  HostPool& pool() { return pool_; }
  int64_t pending() const;
  int64_t offloadedBytes() const { return offloaded_bytes_; }

 private:
  struct Entry;
  std::shared_ptr<Entry> find(int64_t handle, bool remove);
  CopyEngine& engineFor(const c10::Device& device);
  // Returns host buffers whose copies finished to the pool (buffers of fetched entries whose copy
  // back may still be reading them).
  void releaseIdle();

  HostPool pool_;
  mutable std::mutex mu_;
  std::map<c10::DeviceType, std::unique_ptr<CopyEngine>> engines_;  // made on first use
  std::unordered_map<int64_t, std::shared_ptr<Entry>> entries_;
  std::vector<std::pair<std::unique_ptr<Transfer>, at::Tensor>> draining_;
  int64_t next_ = 1;
  int64_t offloaded_bytes_ = 0;
};

}  // namespace offload
}  // namespace bytescale
