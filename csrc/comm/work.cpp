#include "comm/work.h"

#include <ATen/core/jit_type.h>

namespace bytescale {
namespace comm {

namespace {
c10::intrusive_ptr<c10::ivalue::Future> makeTensorListFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}
}  // namespace

FutureWork::FutureWork(int rank, c10d::OpType type, std::string what,
                       std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type),
      what_(std::move(what)),
      outputs_(std::move(outputs)),
      future_(makeTensorListFuture()) {}

bool FutureWork::isCompleted() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

bool FutureWork::isSuccess() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_ && !error_;
}

std::exception_ptr FutureWork::exception() const {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

std::vector<at::Tensor> FutureWork::result() { return outputs_; }

bool FutureWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout == kNoTimeout) {
    done_cv_.wait(lk, [&] { return done_; });
  } else if (!done_cv_.wait_for(lk, timeout, [&] { return done_; })) {
    TORCH_CHECK(false, "bytescale: ", what_, " did not complete within ", timeout.count(),
                " ms (Work.wait timeout)");
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FutureWork::getFuture() { return future_; }

void FutureWork::markDone() {
  {
    std::lock_guard<std::mutex> g(mu_);
    done_ = true;
  }
  done_cv_.notify_all();
  future_->markCompleted(c10::IValue(outputs_));
}

void FutureWork::markFailed(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> g(mu_);
    done_ = true;
    error_ = error;
  }
  done_cv_.notify_all();
  future_->setError(error);
}

ExchangeWork::ExchangeWork(int rank, c10d::OpType type, std::unique_ptr<PendingExchange> pending,
                           std::vector<at::Tensor> tensors)
    : c10d::Work(rank, type), pending_(std::move(pending)), tensors_(std::move(tensors)) {}

bool ExchangeWork::isCompleted() {
  std::lock_guard<std::mutex> g(mu_);
  return waited_;
}

bool ExchangeWork::isSuccess() const {
  std::lock_guard<std::mutex> g(mu_);
  return waited_ && !error_;
}

std::exception_ptr ExchangeWork::exception() const {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

std::vector<at::Tensor> ExchangeWork::result() { return tensors_; }

bool ExchangeWork::wait(std::chrono::milliseconds) {
  std::lock_guard<std::mutex> g(mu_);
  if (!waited_) {
    try {
      if (pending_) pending_->wait();
    } catch (...) {
      error_ = std::current_exception();
    }
    waited_ = true;
    pending_.reset();
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> ExchangeWork::getFuture() {
  // Point-to-point works complete on wait(); the future is completed then.
  wait();
  if (!future_) {
    future_ = makeTensorListFuture();
    future_->markCompleted(c10::IValue(tensors_));
  }
  return future_;
}

c10::intrusive_ptr<c10d::Work> completedWork(int rank, c10d::OpType type,
                                             std::vector<at::Tensor> outputs) {
  auto w = c10::make_intrusive<FutureWork>(rank, type, "noop", std::move(outputs));
  w->markDone();
  return w;
}

}  // namespace comm
}  // namespace bytescale
