// A minimal CUDA event on the raw runtime API (ATen's CUDAEvent header pulls in cuBLAS/cuSPARSE
// headers that a bare CUDA toolkit may lack). Include only from code built with CUDA.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"

namespace bytescale {

class CudaEvent {
 public:
  CudaEvent() = default;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (ev_) (void)cudaEventDestroy(ev_);  // never throws: destructors may run during unwinding
  }

  // Records the event on `s` (created on first use, timing disabled).
  void record(const c10::cuda::CUDAStream& s) {
    if (!ev_) BYTESCALE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    BYTESCALE_CUDA_CHECK(cudaEventRecord(ev_, s.stream()));
  }
  // Makes `s` wait for the event on the GPU (the CPU does not block). No-op if never recorded.
  void block(const c10::cuda::CUDAStream& s) const {
    if (ev_) BYTESCALE_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), ev_, 0));
  }
  // True once the work before the event has run (or if it was never recorded).
  bool query() const {
    if (!ev_) return true;
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // clear the sticky "not ready" status
      return false;
    }
    BYTESCALE_CUDA_CHECK(e);
    return true;
  }
  bool recorded() const { return ev_ != nullptr; }

 private:
  cudaEvent_t ev_ = nullptr;
};

}  // namespace bytescale
