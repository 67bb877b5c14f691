// Block attention with explicit token metadata: the building block of ring attention.
//
// Queries q (Tq, Hq, D) attend keys/values k, v (Tk, Hkv, D), Hq a multiple of Hkv (GQA/MQA).
// Every token carries (document id, position inside the document); query i sees key j iff they
// belong to the same document and, when causal, pos_k[j] <= pos_q[i]. This one rule covers packed
// varlen documents, zig-zag chunks (non-contiguous positions) and the blocks a ring delivers.
//
// The metadata lives on the CPU (it is derived from the layout), so whole tiles that the mask
// empties are skipped without touching the device. Computation is tiled (query tiles x key tiles)
// with an online softmax in fp32 (fp64 for fp64 inputs): no Tq x Tk score matrix is ever
// materialised beyond one tile. Matrix products go through ATen (BLAS on CPU, cuBLAS on CUDA), so
// the same code runs on both devices; fp16/bf16 inputs are computed in fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace bytescale {
namespace attention {

struct TokenMeta {
  at::Tensor doc;  // (T,) int64, CPU
  at::Tensor pos;  // (T,) int64, CPU
};

// Returns out (Tq, Hq, D) in the accumulation dtype and lse (Hq, Tq) (natural log; -inf for
// queries that see no key).
std::tuple<at::Tensor, at::Tensor> blockForward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const TokenMeta& qm,
                                                const TokenMeta& km, bool causal, double scale);

// Gradients of one block given the FINAL output and log-sum-exp of the queries (so blocks can be
// processed independently, in any order, as ring attention's backward does). `delta` is
// rowsum(dout * out) per (head, query), shape (Hq, Tq). Returns dq, dk, dv in the accumulation
// dtype (dk, dv with Hkv heads).
std::tuple<at::Tensor, at::Tensor, at::Tensor> blockBackward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& lse, const at::Tensor& delta, const TokenMeta& qm, const TokenMeta& km,
    bool causal, double scale);

// Merge a block result into running accumulators, in place (numerically stable):
//   new_lse = lse + log1p(exp(lse_b - lse)) computed as max + log(exp(.-max) + exp(.-max))
//   out     = exp(lse - new_lse) * out + exp(lse_b - new_lse) * out_b
// out, out_b: (T, H, D); lse, lse_b: (H, T). -inf entries (nothing seen yet) are handled.
void mergeInto(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b, const at::Tensor& lse_b);

// Accumulation dtype for an input dtype (fp64 stays fp64, everything else fp32).
c10::ScalarType accType(c10::ScalarType t);

}  // namespace attention
}  // namespace bytescale
