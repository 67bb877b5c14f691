// One step of (ring) attention: the queries a rank holds against one K/V block, forward merged into
// running accumulators, backward added into gradient accumulators. The step functions run the
// kernel chooseKernel picks (kernel.h): the built-in tiled kernel (block_attention.h) or a plug-in
// (CUDA: flash attention / cuDNN over the step's segment plan, block_plan.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "attention/block_attention.h"
#include "attention/block_plan.h"

namespace bytescale {
namespace attention {

// Which tokens a query tensor and a K/V tensor hold: whole local documents (ring == 0) or the
// zig-zag shards at ring positions qpos / kpos of a ring of `ring` ranks. Lives for one step.
class BlockPair {
 public:
  BlockPair(const std::vector<int64_t>& lens, int64_t ring, int64_t qpos, int64_t kpos, bool causal)
      : lens(lens), ring(ring), qpos(qpos), kpos(kpos), causal(causal) {}

  const std::vector<int64_t>& lens;
  const int64_t ring, qpos, kpos;
  const bool causal;

  // The step's segment plan, computed on first use and kept (the chooser and the kernel share it).
  const BlockPlan& plan() const;
  // Per-token (document, position) of the queries / keys, for the tiled kernel.
  TokenMeta queryMeta() const;
  TokenMeta keyMeta() const;

 private:
  mutable std::optional<BlockPlan> plan_;
};

// Per-token (document, position) of whole local documents / of ring position i's shard.
TokenMeta localMeta(const std::vector<int64_t>& lens);
TokenMeta shardMeta(const std::vector<int64_t>& lens, int64_t n, int64_t i);

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
