#include "cuda/comm/nccl_watchdog.h"

#include <c10/cuda/CUDAGuard.h>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <thread>

namespace bytescale {
namespace cuda {

// The thread holds this state, never the NcclWatchdog, so the watchdog can be destroyed from any
// thread (including, at worst, its own: it then detaches instead of joining itself).
struct NcclWatchdog::State {
  std::shared_ptr<NcclComm> comm;
  int rank = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<c10::intrusive_ptr<NcclWork>> pending;
  bool stop = false;
  std::thread thread;
};

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(100);

// One pass over the pending Works; returns the failure to abort for ("" if none).
std::string sweep(NcclWatchdog::State& st) {
  // Works exist only once the communicator does. Every CUDA call of this thread (event queries)
  // runs on the communicator's device: a thread whose device was never set would create a context
  // on GPU 0 (~0.5 GiB there for every rank of a node whose GPU is not 0).
  if (!st.comm->connected()) return "";
  const c10::cuda::CUDAGuard device(st.comm->device());
  std::deque<c10::intrusive_ptr<NcclWork>> batch;
  {
    std::lock_guard<std::mutex> g(st.mu);
    batch.swap(st.pending);
  }
  // Outside the lock: releasing tensors may need the GIL, which a tracking thread may hold.
  std::deque<c10::intrusive_ptr<NcclWork>> still;
  std::string failed;
  const auto now = std::chrono::steady_clock::now();
  for (auto& w : batch) {
    bool done = false;
    try {
      done = w->poll();
    } catch (const std::exception& e) {
      if (failed.empty()) failed = std::string("CUDA error while polling: ") + e.what();
    }
    if (done) continue;  // its Work holds no Python-owned tensor (nccl_transport.cpp)
    const auto limit = w->getTimeout();
    if (failed.empty() && limit > std::chrono::milliseconds(0) && now - w->started() > limit)
      failed = w->timeoutMessage(limit);
    still.push_back(w);
  }
  if (failed.empty()) {
    if (auto e = st.comm->asyncError()) failed = *e;
  }
  if (!failed.empty()) {
    // Abort first, then fail the pending Works: their waits raise the abort reason.
    std::fprintf(stderr, "[bytescale watchdog] rank %d: %s; aborting the NCCL communicator\n",
                 st.rank, failed.c_str());
    st.comm->abort(failed);
    for (auto& w : still) w->fail(failed);
    still.clear();
  }
  std::lock_guard<std::mutex> g(st.mu);
  for (auto it = still.rbegin(); it != still.rend(); ++it) st.pending.push_front(*it);
  return failed;
}

void loop(const std::shared_ptr<NcclWatchdog::State>& st) {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(st->mu);
      st->cv.wait_for(lk, kPollInterval, [&] { return st->stop; });
      if (st->stop) return;
    }
    try {
      sweep(*st);
    } catch (...) {
      // Never let an exception end the thread (std::terminate); the next pass retries.
    }
  }
}

}  // namespace

NcclWatchdog::NcclWatchdog(std::shared_ptr<NcclComm> comm, int rank)
    : st_(std::make_shared<State>()) {
  st_->comm = std::move(comm);
  st_->rank = rank;
  auto st = st_;
  st_->thread = std::thread([st] { loop(st); });
}

NcclWatchdog::~NcclWatchdog() { stop(); }

void NcclWatchdog::track(c10::intrusive_ptr<NcclWork> work) {
  std::lock_guard<std::mutex> g(st_->mu);
  st_->pending.push_back(std::move(work));
}

void NcclWatchdog::stop() {
  std::shared_ptr<State> st = st_;
  std::thread t;
  {
    std::lock_guard<std::mutex> g(st->mu);
    st->stop = true;
    t.swap(st->thread);
    st->cv.notify_all();
  }
  if (!t.joinable()) return;
  if (t.get_id() == std::this_thread::get_id())
    t.detach();
  else
    t.join();
}

}  // namespace cuda
}  // namespace bytescale
