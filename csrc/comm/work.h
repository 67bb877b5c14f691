// The Work objects of every bytescale backend (world, dynamic groups, the CUDA plug-in), built on
// c10d::Work's own completion state: whoever finishes an operation calls complete(), which sets
// the c10 Future (the list of outputs, what DDP's communication hook reads) and then
// c10d::Work::finish(), so isCompleted(), isSuccess() and exception() are c10d's.
//
// wait(timeout) honours the explicit timeout, else the group's timeout (WorkInfo::timeout), and
// raises c10::DistBackendError naming the op, the group and the peers that did not answer.
// A wait that times out does not cancel the operation: its tensors stay in use until it ends.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace bytescale {
namespace comm {

class Work : public c10d::Work {
 public:
  // future_devices: empty for a CPU future; the CUDA plug-in passes its device.
  Work(int rank, WorkInfo info, std::vector<at::Tensor> outputs,
       std::vector<c10::Device> future_devices = {});

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  std::chrono::milliseconds getTimeout() const override { return info_.timeout; }

  // Completes the Work (error: fails it). Thread-safe; only the first call counts.
  void complete(std::exception_ptr error = nullptr);
  const WorkInfo& info() const { return info_; }
  // What the operation is waiting for, for the timeout error ("receive from rank 2 (40 bytes)").
  // Set before the Work is shared; called from wait()'s thread.
  void setStallReporter(std::function<std::string()> reporter) { reporter_ = std::move(reporter); }

 protected:
  // Waits until completed or `limit` passed (limit <= 0: forever). True if completed.
  bool waitCompleted(std::chrono::milliseconds limit);
  // The limit a wait(timeout) call uses.
  std::chrono::milliseconds limitFor(std::chrono::milliseconds timeout) const {
    return timeout == kNoTimeout ? info_.timeout : timeout;
  }
  [[noreturn]] void throwTimeout(std::chrono::milliseconds limit, bool explicit_timeout) const;
  void rethrowIfFailed();

  WorkInfo info_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;

 private:
  std::function<std::string()> reporter_;
  bool completing_ = false;  // guarded by mutex_
};

// The Work of a send/recv issued inside a coalescing block (batch_isend_irecv, _coalescing_manager):
// it follows the Work of the whole batch, so it completes when the batch does, on every device
// (on CUDA its wait() is the batch's GPU-side wait).
class CoalescedOpWork final : public Work {
 public:
  CoalescedOpWork(int rank, WorkInfo info, std::vector<at::Tensor> tensors);
  void follow(c10::intrusive_ptr<c10d::Work> batch);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  c10::intrusive_ptr<c10d::Work> batch() const;
  c10::intrusive_ptr<c10d::Work> batch_;  // guarded by mutex_
};

// The Work of a receive from any source: sourceRank() names the rank whose message arrived (the
// sender's group rank; on the world group its global rank), once the Work completed.
class AnySourceWork final : public Work {
 public:
  using Work::Work;
  int sourceRank() const override;
  void setSource(int rank) { source_.store(rank); }

 private:
  std::atomic<int> source_{-1};
};

// Several Works as one (the Work endCoalescing returns when collectives were issued inside the
// block besides the P2P batch): complete when all are.
class WorkList final : public Work {
 public:
  WorkList(int rank, WorkInfo info, std::vector<c10::intrusive_ptr<c10d::Work>> parts);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
  bool future_wired_ = false;  // guarded by mutex_
};

// A Work complete from the start (operations with nothing to do).
c10::intrusive_ptr<Work> completedWork(int rank, WorkInfo info, std::vector<at::Tensor> outputs);

// Wraps a Work of another backend whose future completes with it (ProcessGroupGloo's collectives)
// into a comm::Work: same completion, bytescale's timeout and errors.
c10::intrusive_ptr<Work> adoptWork(const c10::intrusive_ptr<c10d::Work>& native, int rank,
                                   WorkInfo info, std::vector<at::Tensor> outputs);

// The error an operation raises when it failed: a bytescale-prefixed c10::Error keeps its type
// (RuntimeError, DistBackendError in Python); anything else is prefixed with `what`.
std::exception_ptr describeFailure(std::exception_ptr error, const std::string& what);

}  // namespace comm
}  // namespace bytescale
