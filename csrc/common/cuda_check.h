// CUDA runtime error checks for the CUDA plug-ins (csrc/cuda/...). Include only from code built
// with CUDA (the [cuda] section of csrc/sources.txt).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

// Raises a c10::Error naming the failed call and CUDA's description of the error.
#define BYTESCALE_CUDA_CHECK(call)                                                          \
  do {                                                                                      \
    cudaError_t bytescale_cuda_err_ = (call);                                               \
    TORCH_CHECK(bytescale_cuda_err_ == cudaSuccess, "bytescale: CUDA error in " #call ": ", \
                cudaGetErrorString(bytescale_cuda_err_));                                   \
  } while (0)
