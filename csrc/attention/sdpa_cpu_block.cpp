// The "sdpa" kernel of ring-attention steps on CPU (kernel.h): ATen's fused CPU flash attention
// (at::_scaled_dot_product_flash_attention_for_cpu and its backward, the kernel behind torch's
// scaled_dot_product_attention on CPU), one call per segment of the step's plan (block_plan.h).
//
// Every segment is one document's query rows against its key rows, uniformly causal (diagonal
// step, equal lengths, so top-left causal is the right mask) or unmasked. The forward returns the
// segment's log-sum-exp, merged into the step's accumulators like any block (mergeInto); the
// backward takes the FINAL output and log-sum-exp of the queries, so each segment's dQ, dK, dV
// are its exact share of the gradient (the same identity the tiled kernel uses). Grouped-query
// attention expands K/V to the query heads per segment and sums dK/dV back over each group.
//
// Registered for CPU tensors when the extension loads, ranked above the tiled kernel, which
// stays the fallback (float16 inputs, and BYTESCALE_ATTENTION_KERNEL=tiled).
#include <ATen/ATen.h>

#include <memory>
#include <optional>

#include "attention/block_attention.h"
#include "attention/kernel.h"

namespace bytescale {
namespace attention {

namespace {

// (rows, heads, D) -> (1, heads, rows, D), a view.
at::Tensor batchHeads(const at::Tensor& x) { return x.transpose(0, 1).unsqueeze(0); }

// K or V rows for `groups` query heads per kv head: (1, Hq, rows, D).
at::Tensor kvHeads(const at::Tensor& x, int64_t groups) {
  return batchHeads(groups == 1 ? x : x.repeat_interleave(groups, 1));
}

// A (1, Hq, rows, D) gradient of expanded K/V back to (rows, Hkv, D), summed over each group.
at::Tensor kvGrad(const at::Tensor& g, int64_t groups) {
  at::Tensor t = g.squeeze(0).transpose(0, 1);  // (rows, Hq, D)
  if (groups == 1) return t;
  return t.reshape({t.size(0), t.size(1) / groups, groups, t.size(2)}).sum(2);
}

class SdpaCpuKernel final : public BlockKernel {
 public:
  std::string name() const override { return "sdpa"; }
  int rank() const override { return 5; }
  bool availableOn(const c10::Device& device) const override { return device.is_cpu(); }
  bool accepts(const at::Tensor& q, const BlockPair&) const override {
    const auto t = q.scalar_type();
    return t == at::kFloat || t == at::kDouble || t == at::kBFloat16;
  }

  bool forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockPair& bp,
               double scale, at::Tensor& out, at::Tensor& lse) const override {
    const BlockPlan& plan = bp.plan();
    const int64_t groups = q.size(1) / k.size(1);
    for (const Segment& s : plan.segs) {
      auto r = at::_scaled_dot_product_flash_attention_for_cpu(
          batchHeads(q.narrow(0, s.q0, s.qn)), kvHeads(k.narrow(0, s.k0, s.kn), groups),
          kvHeads(v.narrow(0, s.k0, s.kn), groups), 0.0, plan.causal, std::nullopt, scale);
      at::Tensor o = out.narrow(0, s.q0, s.qn), l = lse.narrow(1, s.q0, s.qn);
      mergeInto(o, l, std::get<0>(r).squeeze(0).transpose(0, 1).to(out.scalar_type()),
                std::get<1>(r).squeeze(0).to(lse.scalar_type()));
    }
    return true;
  }

  bool backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor&,
                const BlockPair& bp, double scale, at::Tensor& dq, at::Tensor& dk,
                at::Tensor& dv) const override {
    const BlockPlan& plan = bp.plan();
    const int64_t groups = q.size(1) / k.size(1);
    for (const Segment& s : plan.segs) {
      auto g = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          batchHeads(dout.narrow(0, s.q0, s.qn)), batchHeads(q.narrow(0, s.q0, s.qn)),
          kvHeads(k.narrow(0, s.k0, s.kn), groups), kvHeads(v.narrow(0, s.k0, s.kn), groups),
          batchHeads(out.narrow(0, s.q0, s.qn)), lse.narrow(1, s.q0, s.qn).unsqueeze(0), 0.0,
          plan.causal, std::nullopt, scale);
      dq.narrow(0, s.q0, s.qn).add_(std::get<0>(g).squeeze(0).transpose(0, 1));
      dk.narrow(0, s.k0, s.kn).add_(kvGrad(std::get<1>(g), groups));
      dv.narrow(0, s.k0, s.kn).add_(kvGrad(std::get<2>(g), groups));
    }
    return true;
  }
};

const bool registered = [] {
  registerKernel(c10::DeviceType::CPU, std::make_shared<SdpaCpuKernel>());
  return true;
}();

}  // namespace

}  // namespace attention
}  // namespace bytescale
