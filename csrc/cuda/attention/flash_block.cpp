// The "flash" kernel of ring-attention steps (csrc/attention/kernel.h): ATen's varlen flash
// attention (which returns the log-sum-exp) plus bytescale's own gather / scatter-add / LSE-merge
// kernels (kernels.cu). Registered for CUDA tensors when the extension loads.
//
// A step's segment plan (attention/block_plan.h) becomes ONE varlen call: cu_seqlens from the
// segment lengths, causal only on the diagonal step (where query and key segments have equal
// lengths, so flash's bottom-right-aligned causal mask equals the top-left one), and the rows a
// segment does not cover gathered out beforehand (second query chunks when the keys come from a
// later ring position, first key chunks when they come from an earlier one). All host-side
// metadata travels in one pinned int32 buffer, copied asynchronously on the current stream.
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <memory>

#include "attention/kernel.h"
#include "cuda/attention/kernels.h"

namespace bytescale {
namespace cuda {

namespace {

using attention::BlockPair;
using attention::BlockPlan;

struct Tables {
  at::Tensor cu_q, cu_k;        // int32 (nseg + 1,) on the device
  at::Tensor q_table, k_table;  // int32 (nseg, 3) on the device; undefined = identity
  int64_t q_total = 0, k_total = 0;
};

Tables makeTables(const BlockPlan& p, const at::Device& dev) {
  TORCH_CHECK(p.q_rows < INT32_MAX && p.k_rows < INT32_MAX, "bytescale flash attention: ",
              p.q_rows, " query / ", p.k_rows, " key rows exceed the int32 range of cu_seqlens");
  const int64_t nseg = static_cast<int64_t>(p.segs.size());
  const bool gq = !p.queriesContiguous(), gk = !p.keysContiguous();
  const int64_t size = 2 * (nseg + 1) + (gq ? 3 * nseg : 0) + (gk ? 3 * nseg : 0);
  at::Tensor host = at::empty({size}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  int32_t* h = host.data_ptr<int32_t>();
  int32_t* cq = h;
  int32_t* ck = h + nseg + 1;
  int32_t* tq = ck + nseg + 1;
  int32_t* tk = tq + (gq ? 3 * nseg : 0);
  cq[0] = ck[0] = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    const auto& s = p.segs[i];
    if (gq) {
      tq[3 * i] = cq[i];
      tq[3 * i + 1] = static_cast<int32_t>(s.q0);
      tq[3 * i + 2] = static_cast<int32_t>(s.qn);
    }
    if (gk) {
      tk[3 * i] = ck[i];
      tk[3 * i + 1] = static_cast<int32_t>(s.k0);
      tk[3 * i + 2] = static_cast<int32_t>(s.kn);
    }
    cq[i + 1] = cq[i] + static_cast<int32_t>(s.qn);
    ck[i + 1] = ck[i] + static_cast<int32_t>(s.kn);
  }
  Tables t;
  t.q_total = cq[nseg];
  t.k_total = ck[nseg];
  at::Tensor d = host.to(dev, /*non_blocking=*/true);
  t.cu_q = d.narrow(0, 0, nseg + 1);
  t.cu_k = d.narrow(0, nseg + 1, nseg + 1);
  int64_t off = 2 * (nseg + 1);
  if (gq) {
    t.q_table = d.narrow(0, off, 3 * nseg).view({nseg, 3});
    off += 3 * nseg;
  }
  if (gk) t.k_table = d.narrow(0, off, 3 * nseg).view({nseg, 3});
  return t;
}

at::Tensor gathered(const at::Tensor& x, const at::Tensor& table, int64_t rows, int64_t row_dim = 0) {
  if (!table.defined()) return x;
  auto sizes = x.sizes().vec();
  sizes[row_dim] = rows;
  at::Tensor out = at::empty(sizes, x.options());
  gatherRows(x, out, table, row_dim);
  return out;
}

void checkInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const BlockPlan& p) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "bytescale flash attention: q, k, v must be contiguous");
  TORCH_CHECK(q.size(0) == p.q_rows && k.size(0) == p.k_rows && v.size(0) == p.k_rows,
              "bytescale flash attention: the layout holds ", p.q_rows, " query and ", p.k_rows,
              " key rows but q has ", q.size(0), ", k ", k.size(0), ", v ", v.size(0));
}

// Flash attention's limits in ATen: bf16/fp16, head dim a multiple of 8 up to 256 (and sm80+,
// availableOn).
bool flashShape(const at::Tensor& q) {
  if (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf) return false;
  const int64_t d = q.size(2);
  return d % 8 == 0 && d <= 256;
}

class FlashKernel final : public attention::BlockKernel {
 public:
  std::string name() const override { return "flash"; }
  int rank() const override { return 10; }
  bool availableOn(const c10::Device& device) const override {
    return computeCapabilityMajor(device) >= 8;
  }
  bool accepts(const at::Tensor& q, const BlockPair&) const override { return flashShape(q); }

  bool forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockPair& bp,
               double scale, at::Tensor& out, at::Tensor& lse) const override {
    const BlockPlan& plan = bp.plan();
    checkInputs(q, k, v, plan);
    if (plan.empty()) return true;
    const c10::cuda::CUDAGuard guard(q.device());
    Tables t = makeTables(plan, q.device());
    at::Tensor qs = gathered(q, t.q_table, t.q_total);
    at::Tensor ks = gathered(k, t.k_table, t.k_total), vs = gathered(v, t.k_table, t.k_total);
    auto r = at::_flash_attention_forward(qs, ks, vs, t.cu_q, t.cu_k, plan.maxQ(), plan.maxK(),
                                          0.0, plan.causal, false, scale);
    const at::Tensor& ob = std::get<0>(r);
    const at::Tensor& lb = std::get<1>(r);
    TORCH_CHECK(lb.dim() == 2 && lb.size(0) == q.size(1) && lb.size(1) == t.q_total,
                "bytescale flash attention: unexpected log-sum-exp layout ", lb.sizes(),
                " from this torch's flash kernel (expected (heads, tokens))");
    mergeLse(out, lse, ob, lb, t.q_table);
    return true;
  }

  // One call straight into q's dtype when the plan covers every query row in order.
  std::optional<std::tuple<at::Tensor, at::Tensor>> attend(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const BlockPair& bp,
                                                           double scale) const override {
    const BlockPlan& plan = bp.plan();
    if (!plan.queriesContiguous()) return BlockKernel::attend(q, k, v, bp, scale);
    checkInputs(q, k, v, plan);
    if (plan.empty())
      return std::make_tuple(at::zeros(q.sizes(), q.options()),
                             at::empty({q.size(1), 0}, q.options().dtype(at::kFloat)));
    const c10::cuda::CUDAGuard guard(q.device());
    Tables t = makeTables(plan, q.device());
    at::Tensor ks = gathered(k, t.k_table, t.k_total), vs = gathered(v, t.k_table, t.k_total);
    auto r = at::_flash_attention_forward(q, ks, vs, t.cu_q, t.cu_k, plan.maxQ(), plan.maxK(), 0.0,
                                          plan.causal, false, scale);
    return std::make_tuple(std::get<0>(r), std::get<1>(r));
  }

  bool backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor&,
                const BlockPair& bp, double scale, at::Tensor& dq, at::Tensor& dk,
                at::Tensor& dv) const override {
    const BlockPlan& plan = bp.plan();
    checkInputs(q, k, v, plan);
    if (plan.empty()) return true;
    const c10::cuda::CUDAGuard guard(q.device());
    Tables t = makeTables(plan, q.device());
    at::Tensor qs = gathered(q, t.q_table, t.q_total);
    at::Tensor dos = gathered(dout, t.q_table, t.q_total);
    at::Tensor os = gathered(out, t.q_table, t.q_total);
    at::Tensor ls = gathered(lse, t.q_table, t.q_total, /*row_dim=*/1);
    at::Tensor ks = gathered(k, t.k_table, t.k_total), vs = gathered(v, t.k_table, t.k_total);
    // Dropout is off, so the philox state is never read; flash's signature still takes it.
    at::Tensor seed = at::zeros({2}, q.options().dtype(at::kLong));
    at::Tensor unused = at::empty({0}, q.options().dtype(at::kLong));
    auto g = at::_flash_attention_backward(dos, qs, ks, vs, os, ls, t.cu_q, t.cu_k, plan.maxQ(),
                                           plan.maxK(), 0.0, plan.causal, seed, unused, scale);
    if (t.q_table.defined()) scatterAddRows(dq, std::get<0>(g), t.q_table);
    else dq.add_(std::get<0>(g));
    if (t.k_table.defined()) {
      scatterAddRows(dk, std::get<1>(g), t.k_table);
      scatterAddRows(dv, std::get<2>(g), t.k_table);
    } else {
      dk.add_(std::get<1>(g));
      dv.add_(std::get<2>(g));
    }
    return true;
  }
};

const bool registered = [] {
  attention::registerKernel(c10::DeviceType::CUDA, std::make_shared<FlashKernel>());
  return true;
}();

}  // namespace

}  // namespace cuda
}  // namespace bytescale

// The CUDA kernel of the op bytescale::merge_lse_ (schema and CPU kernel: ring_attention.cpp).
TORCH_LIBRARY_IMPL(bytescale, CUDA, m) {
  m.impl("merge_lse_", [](at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b,
                          const at::Tensor& lse_b) {
    bytescale::cuda::mergeLse(out, lse, out_b, lse_b, at::Tensor());
  });
}
