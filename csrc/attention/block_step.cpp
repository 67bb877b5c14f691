#include "attention/block_step.h"

#include <ATen/ATen.h>

#include "attention/kernel.h"
#include "common/zigzag.h"

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

TokenMeta shardMeta(const std::vector<int64_t>& lens, int64_t n, int64_t i) {
  const int64_t total = zigzag::shard_tokens(lens, n, i);
  TokenMeta m{at::empty({total}, at::kLong), at::empty({total}, at::kLong)};
  int64_t* doc = m.doc.data_ptr<int64_t>();
  int64_t* pos = m.pos.data_ptr<int64_t>();
  int64_t t = 0;
  for (size_t d = 0; d < lens.size(); ++d)
    for (const auto& [a, b] : zigzag::local_ranges(lens[d], n, i))
      for (int64_t p = a; p < b; ++p, ++t) {
        doc[t] = static_cast<int64_t>(d);
        pos[t] = p;
      }
  return m;
}

const BlockPlan& BlockPair::plan() const {
  if (!plan_) plan_ = ring == 0 ? localPlan(lens, causal) : zigzagPlan(lens, ring, qpos, kpos, causal);
  return *plan_;
}
TokenMeta BlockPair::queryMeta() const { return ring == 0 ? localMeta(lens) : shardMeta(lens, ring, qpos); }
TokenMeta BlockPair::keyMeta() const { return ring == 0 ? localMeta(lens) : shardMeta(lens, ring, kpos); }

namespace {

// Runs `run(kernel)` on the chosen kernel; when a kernel rejects the step at run time (returns
// false, accumulators untouched) the step runs on the next kernel down. The tiled kernel, rank 0,
// never rejects, so this ends.
template <typename Run>
void onKernel(const at::Tensor& q, const BlockPair& bp, Run&& run) {
  const BlockKernel* k = &chooseKernel(q, bp);
  while (!run(*k)) {
    TORCH_CHECK(k->rank() > 0, "bytescale attention: internal error, the ", k->name(),
                " kernel rejected a step");
    k = &chooseKernel(q, bp, k);
  }
}

}  // namespace

void forwardStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockPair& bp,
                 double scale, at::Tensor& out, at::Tensor& lse) {
  onKernel(q, bp, [&](const BlockKernel& kern) { return kern.forward(q, k, v, bp, scale, out, lse); });
}

std::tuple<at::Tensor, at::Tensor> attendOnce(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const BlockPair& bp, double scale) {
  std::optional<std::tuple<at::Tensor, at::Tensor>> r;
  onKernel(q, bp, [&](const BlockKernel& kern) {
    r = kern.attend(q, k, v, bp, scale);
    return r.has_value();
  });
  return *r;
}

void backwardStep(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                  at::Tensor& delta, const BlockPair& bp, double scale, at::Tensor& dq,
                  at::Tensor& dk, at::Tensor& dv) {
  onKernel(q, bp, [&](const BlockKernel& kern) {
    return kern.backward(dout, q, k, v, out, lse, delta, bp, scale, dq, dk, dv);
  });
}

}  // namespace attention
}  // namespace bytescale
