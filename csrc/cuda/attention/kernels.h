// The CUDA plug-in of the attention subsystem (csrc/attention/kernel.h): the "flash"
// (flash_block.cpp) and "cudnn" (cudnn_block.cpp) per-step kernels, registered when the extension
// loads, and the CUDA kernels on their hot path (kernels.cu), declared here.
//
// Row maps. A "row table" is an int32 tensor on the device of shape (nseg, 3), one row per
// segment: (packed_start, big_start, length), sorted by packed_start, packed segments back to
// back. Packed row r of a gathered tensor is row big_start + (r - packed_start) of the big one.
// An undefined table means the identity.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace bytescale {
namespace cuda {

// dst (outer, R, W...) = src (outer, Tbig, W...) rows through `table` (dims after the row dim are
// copied as raw bytes, 16-byte vectors where aligned). `row_dim` is 0 for (T, H, D) tensors and 1
// for (H, T) log-sum-exp tensors.
void gatherRows(const at::Tensor& src, at::Tensor& dst, const at::Tensor& table, int64_t row_dim);

// acc (Tbig, W...) float32 += src (R, W...) (float32 / bf16 / fp16) through `table`. Each big row
// is hit at most once (segments never overlap), so no atomics are needed.
void scatterAddRows(at::Tensor& acc, const at::Tensor& src, const at::Tensor& table);

// Numerically stable log-sum-exp merge of one block's result into running accumulators:
//   out (Tbig, H, D) f32, lse (H, Tbig) f32   <-   out_b (R, H, D) f32/bf16/fp16, lse_b (H, R) f32
// through `table` (block row r -> accumulator row). lse_b = -inf or +inf (flash's mark of a row
// that saw no key) leaves the row unchanged. Also the CUDA kernel of the op bytescale::merge_lse_.
void mergeLse(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b, const at::Tensor& lse_b,
              const at::Tensor& table);

// Compute-capability major of a CUDA device (0 if the query fails). Asked by the kernels'
// availableOn / prefersDevice, which the kernel chooser calls once per device.
int computeCapabilityMajor(const c10::Device& device);

}  // namespace cuda
}  // namespace bytescale
