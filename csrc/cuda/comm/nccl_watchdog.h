// The watchdog of the CUDA comm plug-in (after ProcessGroupNCCL's watchdog thread). Nothing in
// c10d watches a custom backend, so this thread does: it completes the Works whose end event
// fired and drops them (a Work holds only Python-free copies of its outputs, so this thread never
// frees a Python-owned tensor, even while the interpreter finalizes), and on a timeout (a Work
// older than its group's timeout) or an asynchronous NCCL error it aborts the communicator, so
// every pending and later wait raises instead of hanging.
#pragma once

#include <memory>

#include "cuda/comm/nccl_work.h"

namespace bytescale {
namespace cuda {

class NcclWatchdog {
 public:
  NcclWatchdog(std::shared_ptr<NcclComm> comm, int rank);
  ~NcclWatchdog();  // stop()
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;

  void track(c10::intrusive_ptr<NcclWork> work);
  // Stops the thread (pending Works are no longer watched). Idempotent; safe from any thread.
  void stop();

  struct State;  // shared with the thread (nccl_watchdog.cpp)

 private:
  std::shared_ptr<State> st_;
};

}  // namespace cuda
}  // namespace bytescale
