#include "attention/block_step.h"

#include <ATen/ATen.h>

#include "attention/zigzag.h"

#ifdef BYTESCALE_WITH_CUDA
#include "cuda/attention/kernels.h"
#endif

namespace bytescale {
namespace attention {

TokenMeta localMeta(const std::vector<int64_t>& lens) {
  int64_t total = 0;
  for (auto n : lens) total += n;
  TokenMeta m{at::empty({total}, at::kLong), at::empty({total}, at::kLong)};
  int64_t* doc = m.doc.data_ptr<int64_t>();
  int64_t* pos = m.pos.data_ptr<int64_t>();
  int64_t t = 0;
  for (size_t d = 0; d < lens.size(); ++d)
    for (int64_t p = 0; p < lens[d]; ++p, ++t) {
      doc[t] = static_cast<int64_t>(d);
      pos[t] = p;
    }
  return m;
}

int64_t shardTokens(const std::vector<int64_t>& lens, int64_t n, int64_t i) {
  int64_t t = 0;
  for (auto s : lens) t += zigzag::local_tokens(s, n, i);
  return t;
}

// Tokens of ring position i: for each document, chunk i then chunk 2N-1-i.
TokenMeta shardMeta(const std::vector<int64_t>& lens, int64_t n, int64_t i) {
  const int64_t total = shardTokens(lens, n, i);
  TokenMeta m{at::empty({total}, at::kLong), at::empty({total}, at::kLong)};
  int64_t* doc = m.doc.data_ptr<int64_t>();
  int64_t* pos = m.pos.data_ptr<int64_t>();
  int64_t t = 0;
  for (size_t d = 0; d < lens.size(); ++d)
    for (int64_t c : {i, 2 * n - 1 - i}) {
      auto [a, b] = zigzag::chunk(lens[d], n, c);
      for (int64_t p = a; p < b; ++p, ++t) {
        doc[t] = static_cast<int64_t>(d);
        pos[t] = p;
      }
    }
  return m;
}

BlockPlan BlockPair::plan() const {
  return ring == 0 ? localPlan(lens, causal) : zigzagPlan(lens, ring, qpos, kpos, causal);
}
TokenMeta BlockPair::queryMeta() const { return ring == 0 ? localMeta(lens) : shardMeta(lens, ring, qpos); }
TokenMeta BlockPair::keyMeta() const { return ring == 0 ? localMeta(lens) : shardMeta(lens, ring, kpos); }

bool fusedKernelFor(const at::Tensor& q) {
#ifdef BYTESCALE_WITH_CUDA
  return cuda::flashUsable(q);
#else
  (void)q;
  return false;
#endif
}

void forwardStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockPair& bp,
                 double scale, at::Tensor& out, at::Tensor& lse) {
#ifdef BYTESCALE_WITH_CUDA
  if (cuda::flashUsable(q)) {
    cuda::flashForwardStep(q, k, v, bp.plan(), scale, out, lse);
    return;
  }
#endif
  auto [ob, lb] = blockForward(q, k, v, bp.queryMeta(), bp.keyMeta(), bp.causal, scale);
  mergeInto(out, lse, ob, lb);
}

std::tuple<at::Tensor, at::Tensor> attendOnce(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const BlockPair& bp, double scale) {
#ifdef BYTESCALE_WITH_CUDA
  if (cuda::flashUsable(q)) {
    BlockPlan plan = bp.plan();
    if (plan.queriesContiguous()) return cuda::flashAttend(q, k, v, plan, scale);
    at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    at::Tensor lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                              q.options().dtype(at::kFloat));
    cuda::flashForwardStep(q, k, v, plan, scale, out, lse);
    return {out.to(q.scalar_type()), lse};
  }
#endif
  auto [ob, lb] = blockForward(q, k, v, bp.queryMeta(), bp.keyMeta(), bp.causal, scale);
  return {ob.to(q.scalar_type()), lb};
}

void backwardStep(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                  at::Tensor& delta, const BlockPair& bp, double scale, at::Tensor& dq,
                  at::Tensor& dk, at::Tensor& dv) {
#ifdef BYTESCALE_WITH_CUDA
  if (cuda::flashUsable(q)) {
    cuda::flashBackwardStep(dout, q, k, v, out, lse, bp.plan(), scale, dq, dk, dv);
    return;
  }
#endif
  if (!delta.defined()) {
    const auto acc = accType(out.scalar_type());
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1).contiguous();
  }
  auto [dqb, dkb, dvb] = blockBackward(dout, q, k, v, lse, delta, bp.queryMeta(), bp.keyMeta(),
                                       bp.causal, scale);
  dq.add_(dqb);
  dk.add_(dkb);
  dv.add_(dvb);
}

}  // namespace attention
}  // namespace bytescale
