// CUDA kernels on ring attention's hot path (kernels.cu), plus the per-step
// flash-attention driver built on them (flash_block.cpp).
//
// Row maps. A "row table" is an int32 tensor on the device of shape (nseg, 3), one row per
// segment: (packed_start, big_start, length), sorted by packed_start, packed segments back to
// back. Packed row r of a gathered tensor is row big_start + (r - packed_start) of the big one.
// An undefined table means the identity.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "attention/block_plan.h"

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
// that saw no key) leaves the row unchanged.
void mergeLse(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b, const at::Tensor& lse_b,
              const at::Tensor& table);

// ---- flash-attention steps (flash_block.cpp) -------------------------------------------------

// Whether the fused path applies: CUDA tensor, bf16/fp16, head dim a multiple of 8 up to 256,
// an sm80+ device, and not switched off with BYTESCALE_ATTENTION_KERNEL=tiled.
bool flashUsable(const at::Tensor& q);

// Attention in one call when the plan covers every query row in order
// (plan.queriesContiguous()): (out in q's dtype, lse (Hq, Tq) f32).
std::tuple<at::Tensor, at::Tensor> flashAttend(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const attention::BlockPlan& plan,
                                               double scale);

// One ring step: attention of q (Tq, Hq, D) to k/v (Tk, Hkv, D) over the plan's segments, merged
// into out (Tq, Hq, D) f32 and lse (Hq, Tq) f32.
void flashForwardStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const attention::BlockPlan& plan, double scale, at::Tensor& out,
                      at::Tensor& lse);

// One ring step of the backward: given the FINAL out (input dtype) and lse (Hq, Tq) f32 of the
// queries, adds this block's gradients into dq (Tq, Hq, D) f32 and dk, dv (Tk, Hkv, D) f32.
void flashBackwardStep(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                       const attention::BlockPlan& plan, double scale, at::Tensor& dq,
                       at::Tensor& dk, at::Tensor& dv);

// ---- cuDNN steps (cudnn_block.cpp) -----------------------------------------------------------

// Whether a step's segments go to cuDNN's fused attention: every segment >= 1024 query and key
// rows, at most 8 segments, head dim <= 128, on Hopper (BYTESCALE_ATTENTION_KERNEL=cudnn: on any
// GPU; =flash: never), and cuDNN has not failed before in this process.
bool cudnnPreferred(const at::Tensor& q, const attention::BlockPlan& plan);
bool cudnnFailed();

// As flashForwardStep / flashBackwardStep; false (accumulators untouched) if cuDNN rejected the
// configuration, after which cudnnPreferred() is false for the rest of the process.
bool cudnnForwardStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const attention::BlockPlan& plan, double scale, at::Tensor& out,
                      at::Tensor& lse);
bool cudnnBackwardStep(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                       const attention::BlockPlan& plan, double scale, at::Tensor& dq,
                       at::Tensor& dk, at::Tensor& dv);

}  // namespace cuda
}  // namespace bytescale
