// Work objects of the bytescale backend's CPU paths (the CUDA ones live in csrc/cuda/).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace bytescale {
namespace comm {

// A Work completed by whoever runs the operation (a worker thread), exposing a c10 Future whose
// value is the list of output tensors (what DDP's communication hook reads).
class FutureWork : public c10d::Work {
 public:
  FutureWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  void markDone();
  void markFailed(std::exception_ptr error);
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A Work for launched point-to-point operations (send, recv, ring exchange): the operations are
// already in flight; wait() waits for them (CPU: blocks; CUDA: the current stream waits).
class ExchangeWork : public c10d::Work {
 public:
  ExchangeWork(int rank, c10d::OpType type, std::unique_ptr<PendingExchange> pending,
               std::vector<at::Tensor> tensors);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  mutable std::mutex mu_;
  std::unique_ptr<PendingExchange> pending_;
  std::vector<at::Tensor> tensors_;
  bool waited_ = false;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A Work that is complete from the start (operations with nothing to do).
c10::intrusive_ptr<c10d::Work> completedWork(int rank, c10d::OpType type,
                                             std::vector<at::Tensor> outputs);

}  // namespace comm
}  // namespace bytescale
