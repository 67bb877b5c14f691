// The CUDA half of the "bytescale" backend: ONE NCCL communicator for the world, its own
// communication stream, ProcessGroupNCCL-style Work semantics, a watchdog, and the CUDA Transport
// that dynamic groups and ring attention use on the same communicator.
//
// STATUS: compiled in CI against the CUDA build of torch; NOT YET RUN on a GPU (no GPU was lent to
// the session that wrote it). Treat every runtime behaviour here as unverified.
//
// Semantics:
//   * The communicator is created on the first world collective (every rank calls those) or by
//     eagerConnect (init_process_group(..., device_id=...)). Point-to-point and dynamic-group ops
//     before that raise an error (creating it lazily from a subset of ranks would deadlock).
//   * An op records an event on the caller's current stream, the comm stream waits on it, NCCL runs
//     on the comm stream, an end event is recorded. Work::wait() makes the caller's current stream
//     wait on the end event: the CPU does not block. Tensors are kept alive by the Work and by
//     recordStream on the caching allocator.
//   * A watchdog thread polls pending works and ncclCommGetAsyncError; past the timeout (or on an
//     async error) it aborts the communicator, and later waits throw an error naming the op.
#pragma once

#include <chrono>
#include <memory>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/transport.h"

namespace bytescale {
namespace cuda {

c10::intrusive_ptr<c10d::Backend> makeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size,
                                                  std::chrono::milliseconds timeout);

// The CUDA Transport on the backend's communicator.
std::shared_ptr<comm::Transport> transportOf(const c10::intrusive_ptr<c10d::Backend>& nccl);

// Create the communicator now, on `device` (every rank must call it).
void eagerConnect(const c10::intrusive_ptr<c10d::Backend>& nccl, c10::DeviceIndex device);

}  // namespace cuda
}  // namespace bytescale
