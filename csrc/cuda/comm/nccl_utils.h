// NCCL helpers of the CUDA comm plug-in (after ProcessGroupNCCL's NCCLUtils): error checks, dtype
// and reduce-op mapping, an exception-safe NCCL group, and NcclComm, the one world communicator
// with its communication stream and abort state.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

// Raises a c10::DistBackendError naming `what` and NCCL's description of the error.
#define BYTESCALE_NCCL_CHECK(call, what)                                                    \
  do {                                                                                      \
    ncclResult_t bytescale_nccl_res_ = (call);                                              \
    TORCH_CHECK_WITH(DistBackendError, bytescale_nccl_res_ == ncclSuccess, "bytescale ",    \
                     what, ": NCCL error in " #call ": ",                                   \
                     ncclGetErrorString(bytescale_nccl_res_));                              \
  } while (0)

namespace bytescale {
namespace cuda {

ncclDataType_t ncclType(at::ScalarType t, const std::string& what);

// A reduce op for NCCL; a PREMUL_SUM op is created on the communicator and destroyed with this.
class NcclRedOp {
 public:
  NcclRedOp(const c10d::ReduceOp& op, const at::Tensor& t, ncclComm_t comm,
            const std::string& what);
  ~NcclRedOp();
  NcclRedOp(const NcclRedOp&) = delete;
  NcclRedOp& operator=(const NcclRedOp&) = delete;
  ncclRedOp_t get() const { return op_; }

 private:
  ncclRedOp_t op_ = ncclSum;
  ncclComm_t comm_ = nullptr;  // set when op_ was created (PREMUL_SUM)
};

// Checks that `op` can run on tensors of `t`'s dtype (raises naming `what`), without creating
// anything: called before an NCCL group opens (an error inside an open group would launch the
// part of the batch queued so far, leaving the peers mismatched).
void checkNcclReduceOp(const c10d::ReduceOp& op, const at::Tensor& t, const std::string& what);
// Every tensor's dtype has an NCCL type (raises naming `what`); before a group opens.
void checkNcclDtypes(const std::vector<at::Tensor>& ts, const std::string& what);

// NCCL calls made by this thread so far (a launch that fails after one was made aborts the
// communicator: the peers may have started their half of the operation).
int64_t ncclCallsOnThisThread();

// Closes an NCCL group even when an exception unwinds between ncclGroupStart and ncclGroupEnd
// (an open group would silently queue every later NCCL call on this thread). Callers validate
// every dtype and reduce op before opening a group, so only NCCL itself can fail inside one.
class NcclGroup {
 public:
  explicit NcclGroup(std::string what);
  void end();
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  std::string what_;
  bool open_ = false;
};

// Every tensor must be a contiguous CUDA tensor on `device` (NCCL works on raw buffers).
void checkNcclTensors(const std::vector<at::Tensor>& ts, c10::Device device,
                      const std::string& what);

// Sends / receives one contiguous tensor (or `numel` elements from `offset` elements in).
void ncclSendTensor(const at::Tensor& t, int peer, ncclComm_t comm, cudaStream_t s,
                    const std::string& what);
void ncclRecvTensor(const at::Tensor& t, int peer, ncclComm_t comm, cudaStream_t s,
                    const std::string& what);

// The world communicator: created once, on one device, by every rank (a world collective or an
// eager connect); aborted by the watchdog on a timeout or an asynchronous NCCL error.
class NcclComm {
 public:
  NcclComm(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
           std::chrono::milliseconds timeout);
  ~NcclComm();  // destroys (or aborts) the communicator; never throws

  // Creates the communicator on cuda:`device` unless it exists; checks a later device matches.
  // The unique id travels through the store under a key of its own per creation (a job
  // re-initialised on the same store never reads a stale id), and ncclCommInitRank is bounded by
  // the group's timeout (it waits for every rank): past it the call raises naming the ranks'
  // rendezvous, instead of hanging.
  void connect(c10::DeviceIndex device);
  // ncclCommSplit of this (connected) communicator: collective over all its ranks, bounded by
  // `timeout` (past it this communicator is aborted and the call raises naming the split).
  // color >= 0: the member's new communicator (rank order by key) as an NcclComm of
  // `store`/`rank`/`size`; color < 0: NCCL's no-color part, returns nullptr.
  std::shared_ptr<NcclComm> split(int color, int key, c10::intrusive_ptr<c10d::Store> store,
                                  int rank, int size, std::chrono::milliseconds timeout);
  bool connected() const;
  // The communicator for an op; raises naming `what` if it does not exist yet or was aborted.
  ncclComm_t require(const std::string& what);
  c10::Device device() const;
  // The communication stream (connected only): the communicator's own CUDA stream, never shared
  // with another communicator (not drawn from torch's pool), destroyed with it.
  c10::cuda::CUDAStream stream() const;

  // Aborts the communicator (idempotent); later require() and waits raise naming `reason`.
  void abort(const std::string& reason);
  bool aborted() const { return aborted_.load(); }
  std::string abortReason() const;
  // NCCL's asynchronous error, if any (ncclCommGetAsyncError).
  std::optional<std::string> asyncError();
  // Destroys the communicator; idempotent, bounded. ncclCommDestroy waits for the operations
  // still queued, which may wait for peers that are gone: the communication stream is given
  // min(timeout, 10 s) to drain, else the communicator is aborted instead.
  void destroy();

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  ncclComm_t comm_ = nullptr;
  c10::Device device_{c10::DeviceType::CUDA, 0};
  std::optional<c10::cuda::CUDAStream> stream_;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;
};

}  // namespace cuda
}  // namespace bytescale
