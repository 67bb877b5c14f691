// One step of (ring) attention: the queries a rank holds against one K/V block, forward merged into
// running accumulators, backward added into gradient accumulators. Chooses the kernel:
//   - CUDA, bf16/fp16, head dim % 8 == 0 and <= 256, sm80+: flash attention (ATen's varlen op) over
//     the step's segment plan (block_plan.h), with bytescale's CUDA gather / scatter-add / LSE-merge
//     kernels around it (csrc/cuda/attention/kernels.cu);
//   - otherwise (CPU, fp32/fp64, odd head dims): the tiled block kernel (block_attention.h).
// BYTESCALE_ATTENTION_KERNEL=tiled forces the tiled kernel everywhere (tests, comparisons).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "attention/block_attention.h"
#include "attention/block_plan.h"

namespace bytescale {
namespace attention {

// Which tokens a query tensor and a K/V tensor hold: whole local documents (ring == 0) or the
// zig-zag shards at ring positions qpos / kpos of a ring of `ring` ranks.
struct BlockPair {
  const std::vector<int64_t>& lens;
  int64_t ring = 0;
  int64_t qpos = 0, kpos = 0;
  bool causal = true;

  BlockPlan plan() const;
  TokenMeta queryMeta() const;
  TokenMeta keyMeta() const;
};

// Per-token (document, position) of whole local documents / of ring position i's shard.
TokenMeta localMeta(const std::vector<int64_t>& lens);
TokenMeta shardMeta(const std::vector<int64_t>& lens, int64_t n, int64_t i);
int64_t shardTokens(const std::vector<int64_t>& lens, int64_t n, int64_t i);

// True when the fused CUDA path runs for these queries.
bool fusedKernelFor(const at::Tensor& q);

// out (Tq, Hq, D) and lse (Hq, Tq) in the accumulation dtype (fp32; fp64 for fp64 inputs),
// initialised to 0 / -inf, absorb q's attention to (k, v).
void forwardStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockPair& bp,
                 double scale, at::Tensor& out, at::Tensor& lse);

// Attention of q to (k, v) in one go when q's rows are all covered by one step (local
// documents, a ring of one): (out in q's dtype, lse).
std::tuple<at::Tensor, at::Tensor> attendOnce(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const BlockPair& bp, double scale);

// Adds this block's gradient contributions to dq (Tq, Hq, D) and dk, dv (Tk, Hkv, D), all in the
// accumulation dtype, given the FINAL out (q's dtype) and lse of the queries. `delta`
// (rowsum(dout * out), (Hq, Tq)) is computed on first use by the tiled kernel and reused.
void backwardStep(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                  at::Tensor& delta, const BlockPair& bp, double scale, at::Tensor& dq,
                  at::Tensor& dk, at::Tensor& dv);

}  // namespace attention
}  // namespace bytescale
