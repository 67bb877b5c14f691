// The "cudnn" kernel of ring-attention steps (csrc/attention/kernel.h): cuDNN's fused attention
// (ATen's _scaled_dot_product_cudnn_attention) for steps whose segments are long: on Hopper
// cuDNN's kernels ran ~1.7x faster than the flash (FA2) kernels ATen ships (H200,
// benchmarks/RESULTS.md), so "auto" takes it on Hopper only. cuDNN's dense op takes one sequence
// per call, so each segment of the step's plan is one call on row slices of q / k / v (no
// gather: a segment's rows are contiguous), viewed (1, H, S, D) over the packed (S, H, D) memory.
// K/V heads are expanded for GQA (and their gradients summed back). Results of all segments are
// computed first and merged afterwards, so a cuDNN error (an unsupported configuration) leaves
// the accumulators untouched: the kernel then disables itself and that step, and every later
// one, runs on the next kernel down (flash). Registered for CUDA tensors when the extension loads.
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

#include "attention/kernel.h"
#include "cuda/attention/kernels.h"

namespace bytescale {
namespace cuda {

namespace {

using attention::BlockPair;
using attention::BlockPlan;

constexpr int64_t kMinRows = 1024;  // shorter segments: flash's varlen call is cheaper
constexpr size_t kMaxSegments = 8;  // more segments: one varlen call beats many dense calls

// (T, H, D) packed rows -> (1, H, T, D) view.
at::Tensor bhsd(const at::Tensor& x) { return x.transpose(0, 1).unsqueeze(0); }

// K/V with Hkv heads -> Hq heads (query head h reads kv head h / rep).
at::Tensor expandHeads(const at::Tensor& x, int64_t hq) {
  const int64_t hkv = x.size(1);
  if (hkv == hq) return x;
  return x.unsqueeze(2).expand({x.size(0), hkv, hq / hkv, x.size(2)}).reshape({x.size(0), hq, x.size(2)});
}

at::Tensor reduceHeads(const at::Tensor& g, int64_t hkv) {
  const int64_t hq = g.size(1);
  if (hkv == hq) return g;
  return g.view({g.size(0), hkv, hq / hkv, g.size(2)}).sum(2);
}

// One-segment row table (block row r -> accumulator row start + r), int32 on the device.
at::Tensor segmentTable(int64_t start, int64_t rows, const at::Device& dev) {
  at::Tensor h = at::empty({1, 3}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  int32_t* p = h.data_ptr<int32_t>();
  p[0] = 0;
  p[1] = static_cast<int32_t>(start);
  p[2] = static_cast<int32_t>(rows);
  return h.to(dev, /*non_blocking=*/true);
}

class CudnnKernel final : public attention::BlockKernel {
 public:
  std::string name() const override { return "cudnn"; }
  int rank() const override { return 20; }
  bool availableOn(const c10::Device& device) const override {
    return computeCapabilityMajor(device) >= 8;
  }
  // Measured faster than flash on Hopper only.
  bool prefersDevice(const c10::Device& device) const override {
    return computeCapabilityMajor(device) == 9;
  }
  bool disabled() const override { return failed_.load(std::memory_order_relaxed); }

  // bf16/fp16, head dim a multiple of 8 up to 128, 1..8 segments of >= 1024 query and key rows.
  bool accepts(const at::Tensor& q, const BlockPair& bp) const override {
    if (disabled()) return false;
    if (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf) return false;
    if (q.size(2) % 8 != 0 || q.size(2) > 128) return false;
    const BlockPlan& plan = bp.plan();
    if (plan.empty() || plan.segs.size() > kMaxSegments) return false;
    for (const auto& s : plan.segs)
      if (s.qn < kMinRows || s.kn < kMinRows) return false;
    return true;
  }

  bool forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockPair& bp,
               double scale, at::Tensor& out, at::Tensor& lse) const override {
    const BlockPlan& plan = bp.plan();
    const c10::cuda::CUDAGuard guard(q.device());
    const int64_t hq = q.size(1);
    std::vector<std::pair<at::Tensor, at::Tensor>> res;
    try {
      for (const auto& s : plan.segs) {
        at::Tensor ks = expandHeads(k.narrow(0, s.k0, s.kn), hq);
        at::Tensor vs = expandHeads(v.narrow(0, s.k0, s.kn), hq);
        auto r = at::_scaled_dot_product_cudnn_attention(bhsd(q.narrow(0, s.q0, s.qn)), bhsd(ks),
                                                         bhsd(vs), std::nullopt, true, 0.0,
                                                         plan.causal, false, scale);
        at::Tensor ob = std::get<0>(r).squeeze(0).transpose(0, 1).contiguous();  // (S, H, D)
        at::Tensor lb = std::get<1>(r).reshape({hq, s.qn}).contiguous();
        res.emplace_back(ob, lb);
      }
    } catch (const c10::Error& e) {
      fail("", e);
      return false;
    }
    for (size_t i = 0; i < res.size(); ++i) {
      const auto& s = plan.segs[i];
      mergeLse(out, lse, res[i].first, res[i].second, segmentTable(s.q0, s.qn, q.device()));
    }
    return true;
  }

  bool backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor&,
                const BlockPair& bp, double scale, at::Tensor& dq, at::Tensor& dk,
                at::Tensor& dv) const override {
    const BlockPlan& plan = bp.plan();
    const c10::cuda::CUDAGuard guard(q.device());
    const int64_t hq = q.size(1), hkv = k.size(1);
    std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>> res;
    try {
      at::Tensor seed = at::empty({}, q.options().dtype(at::kLong));
      at::Tensor offset = at::empty({}, q.options().dtype(at::kLong));
      for (const auto& s : plan.segs) {
        at::Tensor qs = bhsd(q.narrow(0, s.q0, s.qn));
        at::Tensor ks = bhsd(expandHeads(k.narrow(0, s.k0, s.kn), hq));
        at::Tensor vs = bhsd(expandHeads(v.narrow(0, s.k0, s.kn), hq));
        at::Tensor os = bhsd(out.narrow(0, s.q0, s.qn));
        at::Tensor dos = bhsd(dout.narrow(0, s.q0, s.qn));
        at::Tensor ls = lse.narrow(1, s.q0, s.qn).contiguous().view({1, hq, s.qn, 1});
        auto g = at::_scaled_dot_product_cudnn_attention_backward(
            dos, qs, ks, vs, os, ls, seed, offset, at::Tensor(), at::Tensor(), at::Tensor(), s.qn,
            s.kn, 0.0, plan.causal, scale);
        res.emplace_back(std::get<0>(g).squeeze(0).transpose(0, 1),
                         reduceHeads(std::get<1>(g).squeeze(0).transpose(0, 1), hkv),
                         reduceHeads(std::get<2>(g).squeeze(0).transpose(0, 1), hkv));
      }
    } catch (const c10::Error& e) {
      fail(" backward", e);
      return false;
    }
    for (size_t i = 0; i < res.size(); ++i) {
      const auto& s = plan.segs[i];
      dq.narrow(0, s.q0, s.qn).add_(std::get<0>(res[i]));
      dk.narrow(0, s.k0, s.kn).add_(std::get<1>(res[i]));
      dv.narrow(0, s.k0, s.kn).add_(std::get<2>(res[i]));
    }
    return true;
  }

 private:
  void fail(const char* which, const c10::Error& e) const {
    failed_ = true;
    TORCH_WARN("bytescale: cuDNN attention", which, " failed (", e.what_without_backtrace(),
               "); using flash attention from now on");
  }

  mutable std::atomic<bool> failed_{false};
};

const bool registered = [] {
  // ATen builds (and caches) one cuDNN graph per exact shape, and a packed varlen step has new
  // segment lengths nearly every micro-batch: each would pay a graph build. ATen's
  // TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (experimental in torch 2.14) runs the dense op through
  // cuDNN's ragged path with sequence lengths rounded up to a power of two in the graph key, so
  // lengths within a power of two share one graph (inputs must be BSHD in memory: the row slices
  // of packed (T, H, D) tensors viewed (1, H, S, D), as here). Turned on unless the user set it
  // (=0 keeps one graph per shape). ATen reads it once, at its first cuDNN attention call.
  setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1", /*overwrite=*/0);
  attention::registerKernel(c10::DeviceType::CUDA, std::make_shared<CudnnKernel>());
  return true;
}();

}  // namespace

}  // namespace cuda
}  // namespace bytescale
