#include "offload/copy_engine.h"

#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "common/handoff.h"

namespace bytescale {
namespace offload {

// ---- registry ------------------------------------------------------------------------------------

namespace {

struct Registry {
  std::mutex mu;
  std::map<c10::DeviceType, CopyEngineFactory> factories{{c10::DeviceType::CPU, makeCpuCopyEngine}};
};

// Never destroyed: plug-ins register from static initialisers of the same library.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

}  // namespace

void registerCopyEngine(c10::DeviceType device, CopyEngineFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.factories[device] = std::move(factory);
}

bool hasCopyEngine(c10::DeviceType device) {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  return r.factories.count(device) > 0;
}

std::unique_ptr<CopyEngine> makeCopyEngine(c10::DeviceType device) {
  CopyEngineFactory f;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> g(r.mu);
    auto it = r.factories.find(device);
    if (it == r.factories.end()) return nullptr;
    f = it->second;
  }
  return f();
}

// ---- the CPU engine: host-to-host copies on a worker thread ----------------------------------------

namespace {

// A transfer's state, shared with the worker's jobs.
struct CpuState {
  std::mutex m;
  std::condition_variable cv;
  bool to_host_done = false, to_dev_started = false, to_dev_done = false;
  std::exception_ptr err;
  at::Tensor host, restored;

  void finish(bool to_host, std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> g(m);
      if (e && !err) err = e;
      (to_host ? to_host_done : to_dev_done) = true;
    }
    cv.notify_all();
  }
  // Waits for every started copy; rethrows the first error.
  void waitIdle(std::unique_lock<std::mutex>& lk) {
    cv.wait(lk, [&] { return to_host_done && (!to_dev_started || to_dev_done); });
    if (err) std::rethrow_exception(err);
  }
};

// One worker thread; jobs run in submission order, so a copy back starts after its copy out.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();  // runs the queued jobs first
  }
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        job = std::move(q_.front());
        q_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::thread thread_;
};

// A copy job that records its completion (and any error) in the transfer's state.
std::function<void()> job(std::shared_ptr<CpuState> s, bool to_host, std::function<void()> copy) {
  return [s = std::move(s), to_host, copy = std::move(copy)] {
    std::exception_ptr e;
    try {
      copy();
    } catch (...) {
      e = std::current_exception();
    }
    s->finish(to_host, e);
  };
}

class CpuTransfer final : public Transfer {
 public:
  CpuTransfer(std::shared_ptr<Worker> worker, const at::Tensor& src, const at::Tensor& host)
      : worker_(std::move(worker)), s_(std::make_shared<CpuState>()) {
    // The worker frees what it holds: never a TensorImpl Python has seen (common/handoff.h).
    s_->host = handOff(host);
    // The job holds the only engine reference to src: its memory goes when the copy is done.
    worker_->submit(job(s_, true, [s = s_.get(), t = handOff(src)]() mutable {
      s->host.copy_(t);
      t.reset();
    }));
  }

  void toDevice() override {
    {
      std::lock_guard<std::mutex> g(s_->m);
      if (s_->to_dev_started) return;
      s_->to_dev_started = true;
    }
    // Allocated here, by the consumer's thread; the worker only fills it.
    s_->restored = at::empty_strided(s_->host.sizes(), s_->host.strides(), s_->host.options());
    worker_->submit(job(s_, false, [s = s_.get()] { s->restored.copy_(s->host); }));
  }

  at::Tensor restored() override {
    std::unique_lock<std::mutex> lk(s_->m);
    TORCH_CHECK(s_->to_dev_started, "bytescale offload: internal error, restored() before toDevice()");
    s_->waitIdle(lk);
    return handOff(s_->restored);  // the caller's own TensorImpl; the worker's stays Python-free
  }

  bool hostIdle() override {
    std::lock_guard<std::mutex> g(s_->m);
    return s_->to_host_done && (!s_->to_dev_started || s_->to_dev_done);
  }

  void waitHostIdle() override {
    std::unique_lock<std::mutex> lk(s_->m);
    s_->waitIdle(lk);
  }

 private:
  std::shared_ptr<Worker> worker_;
  std::shared_ptr<CpuState> s_;
};

class CpuCopyEngine final : public CopyEngine {
 public:
  bool pinnedHost() const override { return false; }
  std::unique_ptr<Transfer> toHost(const at::Tensor& src, const at::Tensor& host) override {
    return std::make_unique<CpuTransfer>(worker_, src, host);
  }

 private:
  std::shared_ptr<Worker> worker_ = std::make_shared<Worker>();
};

}  // namespace

std::unique_ptr<CopyEngine> makeCpuCopyEngine() { return std::make_unique<CpuCopyEngine>(); }

}  // namespace offload
}  // namespace bytescale
