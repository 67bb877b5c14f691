#include "offload/offload.h"

#include <ATen/ATen.h>

#include <algorithm>

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
  at::Tensor host;  // pool buffer (bytes)
  bool to_dev_started = false;  // guarded by Engine::mu_
  std::unique_ptr<Transfer> xfer;
};

Engine::Engine(int64_t pool_limit_bytes) : pool_(pool_limit_bytes) {}

Engine::~Engine() = default;

CopyEngine& Engine::engineFor(const c10::Device& device) {
  std::lock_guard<std::mutex> g(mu_);
  auto& e = engines_[device.type()];
  if (!e) {
    e = makeCopyEngine(device.type());
    if (!e) {
      engines_.erase(device.type());
      TORCH_CHECK(false, "bytescale offload: no copy engine for ", device, " tensors",
                  device.is_cuda() ? " (bytescale was built without CUDA)" : "");
    }
  }
  return *e;
}

std::shared_ptr<Engine::Entry> Engine::find(int64_t handle, bool remove) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(handle);
  TORCH_CHECK(it != entries_.end(), "bytescale offload: unknown handle ", handle);
  auto e = it->second;
  if (remove) entries_.erase(it);
  return e;
}

void Engine::releaseIdle() {
  std::vector<at::Tensor> idle;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < draining_.size();) {
      if (draining_[i].first->hostIdle()) {
        idle.push_back(std::move(draining_[i].second));
        draining_[i] = std::move(draining_.back());
        draining_.pop_back();
      } else {
        ++i;
      }
    }
  }
  for (auto& buf : idle) pool_.release(std::move(buf));
}

int64_t Engine::offload(const at::Tensor& t) {
  TORCH_CHECK(t.is_non_overlapping_and_dense(),
              "bytescale offload: only non-overlapping dense tensors can be offloaded (got sizes ",
              t.sizes(), ", strides ", t.strides(), "); expanded or overlapping views cannot be restored");
  CopyEngine& engine = engineFor(t.device());
  releaseIdle();
  auto e = std::make_shared<Entry>();
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  e->host = pool_.acquire(bytes, engine.pinnedHost());
  // The host copy has t's strides (a dense layout spans exactly numel elements), so both copies
  // are plain memory copies and the restored tensor has t's layout.
  at::Tensor host = e->host.narrow(0, 0, bytes).view(t.scalar_type()).as_strided(t.sizes(), t.strides());
  try {
    e->xfer = engine.toHost(t, host);
  } catch (...) {
    pool_.release(std::move(e->host));
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  const int64_t h = next_++;
  entries_[h] = e;
  offloaded_bytes_ += bytes;
  return h;
}

void Engine::prefetch(int64_t handle) {
  auto e = find(handle, /*remove=*/false);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (e->to_dev_started) return;
    e->to_dev_started = true;
  }
  e->xfer->toDevice();
}

at::Tensor Engine::fetch(int64_t handle) {
  prefetch(handle);
  auto e = find(handle, /*remove=*/true);
  at::Tensor out = e->xfer->restored();  // on a copy error the buffer is not reused
  if (e->xfer->hostIdle()) {
    pool_.release(std::move(e->host));
  } else {  // the copy back may still read the host buffer: it returns to the pool later
    std::lock_guard<std::mutex> g(mu_);
    draining_.emplace_back(std::move(e->xfer), std::move(e->host));
  }
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
  e->xfer->waitHostIdle();  // rare path: no copy may touch the buffer once it is reused
  pool_.release(std::move(e->host));
}

int64_t Engine::pending() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>(entries_.size());
}

}  // namespace offload
}  // namespace bytescale
