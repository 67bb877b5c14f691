#include "comm/work.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <sstream>

namespace bytescale {
namespace comm {

namespace {

c10::intrusive_ptr<c10::ivalue::Future> makeFuture(std::vector<c10::Device> devices) {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                  std::move(devices));
}

// Waits longer than this are "forever" (no overflow in steady_clock arithmetic).
constexpr std::chrono::milliseconds kForever{std::chrono::hours(24 * 365)};

std::string listRanks(const std::vector<int>& ranks, size_t max = 16) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size() && i < max; ++i) os << (i ? ", " : "") << ranks[i];
  if (ranks.size() > max) os << ", ... (" << ranks.size() << " ranks)";
  return os.str();
}

std::string defaultStall(const WorkInfo& info, int rank) {
  std::vector<int> peers = info.peers;
  if (peers.empty() && info.group)
    for (int r : info.group->ranks())
      if (r != rank) peers.push_back(r);
  if (peers.empty()) return "no peer is involved";
  return std::string(peers.size() == 1 ? "waiting for rank " : "waiting for ranks ") +
         listRanks(peers);
}

}  // namespace

// ---- Work -------------------------------------------------------------------------------------

Work::Work(int rank, WorkInfo info, std::vector<at::Tensor> outputs,
           std::vector<c10::Device> future_devices)
    : c10d::Work(rank, info.type),
      info_(std::move(info)),
      outputs_(std::move(outputs)),
      future_(makeFuture(std::move(future_devices))) {}

void Work::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> g(mutex_);
    if (completing_ || completed_) return;
    completing_ = true;
  }
  // The future first (as ProcessGroupGloo does): whoever returns from wait() finds it set.
  // Its callbacks (DDP's hook) run here, on the completing thread, with no lock held.
  try {
    if (error)
      future_->setErrorIfNeeded(error);
    else if (!future_->completed())
      future_->markCompleted(c10::IValue(outputs_));
  } catch (...) {
    if (!error) error = std::current_exception();  // a future callback threw
  }
  finish(error);
}

bool Work::waitCompleted(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lk(mutex_);
  if (limit <= std::chrono::milliseconds(0) || limit >= kForever) {
    cv_.wait(lk, [&] { return completed_; });
    return true;
  }
  return cv_.wait_for(lk, limit, [&] { return completed_; });
}

void Work::rethrowIfFailed() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> g(mutex_);
    e = exception_;
  }
  if (e) std::rethrow_exception(e);
}

bool Work::wait(std::chrono::milliseconds timeout) {
  const auto limit = limitFor(timeout);
  if (!waitCompleted(limit)) throwTimeout(limit, timeout != kNoTimeout);
  rethrowIfFailed();
  return true;
}

void Work::throwTimeout(std::chrono::milliseconds limit, bool explicit_timeout) const {
  std::string stall;
  try {
    stall = reporter_ ? reporter_() : defaultStall(info_, rank_);
  } catch (...) {
    stall = defaultStall(info_, rank_);
  }
  std::ostringstream os;
  os << "bytescale " << info_.what << ": Timed out after " << limit.count() << " ms ("
     << (explicit_timeout ? "the timeout passed to wait()" : "the process group's timeout")
     << ") and not complete; " << stall
     << ". The operation is still pending and keeps its tensors.";
  TORCH_CHECK_WITH(DistBackendError, false, os.str());
}

// ---- CoalescedOpWork --------------------------------------------------------------------------

CoalescedOpWork::CoalescedOpWork(int rank, WorkInfo info, std::vector<at::Tensor> tensors)
    : Work(rank, std::move(info), std::move(tensors)) {}

void CoalescedOpWork::follow(c10::intrusive_ptr<c10d::Work> batch) {
  {
    std::lock_guard<std::mutex> g(mutex_);
    batch_ = batch;
  }
  cv_.notify_all();
}

c10::intrusive_ptr<c10d::Work> CoalescedOpWork::batch() const {
  std::lock_guard<std::mutex> g(mutex_);
  return batch_;
}

bool CoalescedOpWork::isCompleted() {
  auto b = batch();
  return b && b->isCompleted();
}

bool CoalescedOpWork::isSuccess() const {
  auto b = batch();
  return b && b->isSuccess();
}

std::exception_ptr CoalescedOpWork::exception() const {
  auto b = batch();
  return b ? b->exception() : nullptr;
}

bool CoalescedOpWork::wait(std::chrono::milliseconds timeout) {
  auto b = batch();
  TORCH_CHECK(b, "bytescale ", info_.what,
              ": waited on inside its coalescing block; the operation is launched when the block "
              "ends (wait after leaving it, or on the Work the block returns)");
  return b->wait(timeout);
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedOpWork::getFuture() {
  auto b = batch();
  TORCH_CHECK(b, "bytescale ", info_.what, ": get_future() inside its coalescing block");
  // This op's own tensor, once the batch's future completes (then() keeps the batch's devices
  // and streams: on CUDA the value is ready on the communication stream, as the batch's is).
  auto outputs = outputs_;
  return b->getFuture()->then([outputs](c10::ivalue::Future&) { return c10::IValue(outputs); },
                              c10::ListType::create(c10::TensorType::get()));
}

// ---- AnySourceWork ----------------------------------------------------------------------------

int AnySourceWork::sourceRank() const {
  const int r = source_.load();
  TORCH_CHECK(r >= 0, "bytescale ", info_.what,
              ": the source rank is known once the receive completed (wait() first)");
  return r;
}

// ---- WorkList ---------------------------------------------------------------------------------

WorkList::WorkList(int rank, WorkInfo info, std::vector<c10::intrusive_ptr<c10d::Work>> parts)
    : Work(rank, std::move(info), {}), parts_(std::move(parts)) {
  for (const auto& p : parts_) {
    auto r = p->result();
    outputs_.insert(outputs_.end(), r.begin(), r.end());
  }
}

bool WorkList::isCompleted() {
  for (auto& p : parts_)
    if (!p->isCompleted()) return false;
  return true;
}

bool WorkList::isSuccess() const {
  for (auto& p : parts_)
    if (!p->isSuccess()) return false;
  return true;
}

std::exception_ptr WorkList::exception() const {
  for (auto& p : parts_)
    if (auto e = p->exception()) return e;
  return nullptr;
}

bool WorkList::wait(std::chrono::milliseconds timeout) {
  // One deadline for the whole list; each part raises its own error naming its op and peers.
  const auto limit = limitFor(timeout);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (auto& p : parts_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (limit <= std::chrono::milliseconds(0) || limit >= std::chrono::hours(24 * 365))
      p->wait(timeout);
    else
      p->wait(std::max(left, std::chrono::milliseconds(1)));
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkList::getFuture() {
  {
    std::lock_guard<std::mutex> g(mutex_);
    if (future_wired_) return future_;
    future_wired_ = true;
  }
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futs;
  for (auto& p : parts_) futs.push_back(p->getFuture());
  auto left = std::make_shared<std::atomic<size_t>>(futs.size());
  auto out = future_;
  auto outputs = outputs_;
  for (auto& f : futs) {
    f->addCallback([out, outputs, futs, left](c10::ivalue::Future&) {
      if (left->fetch_sub(1) != 1 || out->completed()) return;  // the last part completes it
      for (const auto& part : futs) {
        if (part->hasError()) {
          out->setErrorIfNeeded(part->exception_ptr());
          return;
        }
      }
      out->markCompleted(c10::IValue(outputs));
    });
  }
  return out;
}

// ---- helpers ----------------------------------------------------------------------------------

c10::intrusive_ptr<Work> completedWork(int rank, WorkInfo info, std::vector<at::Tensor> outputs) {
  auto w = c10::make_intrusive<Work>(rank, std::move(info), std::move(outputs));
  w->complete();
  return w;
}

c10::intrusive_ptr<Work> adoptWork(const c10::intrusive_ptr<c10d::Work>& native, int rank,
                                   WorkInfo info, std::vector<at::Tensor> outputs) {
  auto w = c10::make_intrusive<Work>(rank, std::move(info), std::move(outputs));
  const std::string what = w->info().what;
  // The native Work stays alive (with its tensors) until its future completes.
  native->getFuture()->addCallback([w, native, what](c10::ivalue::Future& f) {
    w->complete(f.hasError() ? describeFailure(f.exception_ptr(), what) : nullptr);
  });
  return w;
}

std::exception_ptr describeFailure(std::exception_ptr error, const std::string& what) {
  if (!error) return error;
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    if (e.msg().rfind("bytescale", 0) == 0) return error;
    return std::make_exception_ptr(
        c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              "bytescale " + what + " failed: " + e.msg()));
  } catch (const std::exception& e) {
    // bytescale's own errors keep their type; a transport's (Gloo's IoException, a lost peer) is a
    // DistBackendError like every other communication failure, whoever ran the collective.
    std::string msg = e.what();
    if (msg.rfind("bytescale", 0) == 0) return error;
    return std::make_exception_ptr(
        c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              "bytescale " + what + " failed: " + msg));
  } catch (...) {
    return error;
  }
}

}  // namespace comm
}  // namespace bytescale
