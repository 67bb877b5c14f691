// Ring attention and local varlen attention as torch custom ops (TORCH_LIBRARY "bytescale").
//
//   bytescale::varlen_attn_fwd / _bwd : packed documents that are wholly local (no communication).
//   bytescale::ring_attn_fwd  / _bwd  : packed documents sharded zig-zag over a ring of global
//                                        ranks (csrc/attention/zigzag.h), any lengths.
//
// The ring runs over the world Transport of the tensors' device (comm/transport.h), so the same
// code runs on Gloo (CPU) and NCCL (CUDA). Forward: at step s rank i attends its queries to the
// K/V block of ring position (i - s) while the next block is already in flight (ringStep), and
// merges the partial result into fp32 accumulators through the log-sum-exp. Backward: dQ
// accumulates locally; each K/V block travels the ring again together with its dK/dV accumulator
// (fp32 by default, bf16 on request), every member adding its contribution; after N hops the
// accumulator is back at its owner.
//
// Autograd and fake (meta) kernels are registered from Python (bytescale/ring.py) with
// torch.library, so torch.compile can trace models using these ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <string>

#include "attention/block_attention.h"
#include "attention/zigzag.h"
#include "comm/transport.h"

namespace bytescale {
namespace attention {

namespace {

std::vector<int64_t> checkedLens(c10::IntArrayRef doc_lens, const char* what) {
  std::vector<int64_t> v(doc_lens.begin(), doc_lens.end());
  for (size_t d = 0; d < v.size(); ++d)
    TORCH_CHECK(v[d] >= 0, "bytescale ", what, ": document ", d, " has negative length ", v[d]);
  return v;
}

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

double resolveScale(double scale, const at::Tensor& q) {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
}

// (T, H) delta = rowsum(dout * out) -> (H, T)
at::Tensor rowDelta(const at::Tensor& dout, const at::Tensor& out) {
  const auto acc = accType(out.scalar_type());
  return (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1).contiguous();
}

struct Ring {
  std::vector<int64_t> ranks;
  int64_t n = 1, me = 0;
  std::shared_ptr<comm::Transport> tr;
  std::string what;
};

Ring makeRing(c10::IntArrayRef ranks, const at::Tensor& q, const char* op) {
  Ring r;
  r.ranks.assign(ranks.begin(), ranks.end());
  r.n = static_cast<int64_t>(r.ranks.size());
  TORCH_CHECK(r.n >= 1, "bytescale ", op, ": empty ring");
  std::string desc = "[";
  for (size_t k = 0; k < r.ranks.size(); ++k) desc += (k ? ", " : "") + std::to_string(r.ranks[k]);
  desc += "]";
  r.what = std::string(op) + " on ring " + desc;
  if (r.n == 1) {
    r.me = 0;
    return r;
  }
  r.tr = comm::worldTransport(q.device().type());
  TORCH_CHECK(r.tr, "bytescale ", r.what, ": no bytescale transport for ", q.device(),
              " tensors; call dist.init_process_group(\"bytescale\") first");
  auto it = std::find(r.ranks.begin(), r.ranks.end(), r.tr->rank());
  TORCH_CHECK(it != r.ranks.end(), "bytescale ", r.what, ": rank ", r.tr->rank(),
              " is not a member of the ring");
  for (auto x : r.ranks)
    TORCH_CHECK(x >= 0 && x < r.tr->worldSize(), "bytescale ", r.what, ": rank ", x,
                " outside the world of ", r.tr->worldSize());
  r.me = it - r.ranks.begin();
  return r;
}

int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

}  // namespace

std::tuple<at::Tensor, at::Tensor> varlenFwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, c10::IntArrayRef doc_lens,
                                             bool causal, double scale) {
  auto lens = checkedLens(doc_lens, "varlen attention");
  TokenMeta m = localMeta(lens);
  TORCH_CHECK(m.doc.numel() == q.size(0) && k.size(0) == q.size(0), "bytescale varlen attention: "
              "document lengths sum to ", m.doc.numel(), " but q has ", q.size(0), " and k ",
              k.size(0), " tokens");
  auto [out, lse] = blockForward(q, k, v, m, m, causal, resolveScale(scale, q));
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlenBwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef doc_lens, bool causal,
    double scale) {
  auto lens = checkedLens(doc_lens, "varlen attention backward");
  TokenMeta m = localMeta(lens);
  auto [dq, dk, dv] = blockBackward(dout, q, k, v, lse, rowDelta(dout, out), m, m, causal,
                                    resolveScale(scale, q));
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> ringFwd(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, c10::IntArrayRef doc_lens,
                                           c10::IntArrayRef ranks, bool causal, double scale) {
  auto lens = checkedLens(doc_lens, "ring attention");
  Ring ring = makeRing(ranks, q, "ring attention");
  const double sc = resolveScale(scale, q);
  TokenMeta qm = shardMeta(lens, ring.n, ring.me);
  TORCH_CHECK(qm.doc.numel() == q.size(0) && k.size(0) == q.size(0), "bytescale ", ring.what,
              ": ring position ", ring.me, " of ", ring.n, " holds ", qm.doc.numel(),
              " tokens of documents ", doc_lens, " but q has ", q.size(0), " and k ", k.size(0));
  if (ring.n == 1) {
    auto [out, lse] = blockForward(q, k, v, qm, qm, causal, sc);
    return {out.to(q.scalar_type()), lse};
  }
  const auto acc = accType(q.scalar_type());
  at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2)}, q.options().dtype(acc));
  at::Tensor lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc));
  at::Tensor cur = at::cat({k, v}, 0).contiguous();  // (2T, Hkv, D): one message per step
  int64_t src = ring.me;
  const int next = static_cast<int>(ring.ranks[mod(ring.me + 1, ring.n)]);
  const int prev = static_cast<int>(ring.ranks[mod(ring.me - 1, ring.n)]);
  for (int64_t s = 0; s < ring.n; ++s) {
    std::unique_ptr<comm::PendingExchange> pending;
    at::Tensor buf;
    int64_t nsrc = mod(ring.me - s - 1, ring.n);
    if (s + 1 < ring.n) {
      buf = at::empty({2 * shardTokens(lens, ring.n, nsrc), k.size(1), k.size(2)}, k.options());
      pending = ring.tr->ringStep(cur, next, buf, prev, ring.what);
    }
    const int64_t t = cur.size(0) / 2;
    TokenMeta km = shardMeta(lens, ring.n, src);
    auto [ob, lb] = blockForward(q, cur.narrow(0, 0, t), cur.narrow(0, t, t), qm, km, causal, sc);
    mergeInto(out, lse, ob, lb);
    if (pending) {
      pending->wait();
      cur = buf;
      src = nsrc;
    }
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ringBwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef doc_lens,
    c10::IntArrayRef ranks, bool causal, double scale, bool bf16_grad_comm) {
  auto lens = checkedLens(doc_lens, "ring attention backward");
  Ring ring = makeRing(ranks, q, "ring attention backward");
  const double sc = resolveScale(scale, q);
  TokenMeta qm = shardMeta(lens, ring.n, ring.me);
  at::Tensor delta = rowDelta(dout, out);
  if (ring.n == 1) {
    auto [dq, dk, dv] = blockBackward(dout, q, k, v, lse, delta, qm, qm, causal, sc);
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
  }
  const auto acc = accType(q.scalar_type());
  const auto comm_dt = bf16_grad_comm && acc == at::kFloat ? at::kBFloat16 : acc;
  at::Tensor dq = at::zeros({q.size(0), q.size(1), q.size(2)}, q.options().dtype(acc));
  at::Tensor cur = at::cat({k, v}, 0).contiguous();
  at::Tensor dkv = at::zeros({cur.size(0), cur.size(1), cur.size(2)}, q.options().dtype(acc));
  int64_t src = ring.me;
  const int next = static_cast<int>(ring.ranks[mod(ring.me + 1, ring.n)]);
  const int prev = static_cast<int>(ring.ranks[mod(ring.me - 1, ring.n)]);
  for (int64_t s = 0; s < ring.n; ++s) {
    const int64_t nsrc = mod(ring.me - s - 1, ring.n);
    const int64_t nt = shardTokens(lens, ring.n, nsrc);
    std::unique_ptr<comm::PendingExchange> pending_kv;
    at::Tensor kv_buf;
    if (s + 1 < ring.n) {
      kv_buf = at::empty({2 * nt, k.size(1), k.size(2)}, k.options());
      pending_kv = ring.tr->ringStep(cur, next, kv_buf, prev, ring.what);
    }
    const int64_t t = cur.size(0) / 2;
    TokenMeta km = shardMeta(lens, ring.n, src);
    auto [dqb, dkb, dvb] = blockBackward(dout, q, cur.narrow(0, 0, t), cur.narrow(0, t, t), lse,
                                         delta, qm, km, causal, sc);
    dq.add_(dqb);
    dkv.narrow(0, 0, t).add_(dkb);
    dkv.narrow(0, t, t).add_(dvb);
    // The accumulator follows its block to the next rank; after N hops it is home.
    at::Tensor send = dkv.to(comm_dt).contiguous();
    at::Tensor recv = at::empty({2 * nt, k.size(1), k.size(2)}, q.options().dtype(comm_dt));
    ring.tr->ringStep(send, next, recv, prev, ring.what + " (dK/dV)")->wait();
    dkv = recv.to(acc);
    if (pending_kv) {
      pending_kv->wait();
      cur = kv_buf;
      src = nsrc;
    }
  }
  const int64_t own = k.size(0);
  TORCH_CHECK(dkv.size(0) == 2 * own, "bytescale ", ring.what, ": internal error, dK/dV of ",
              dkv.size(0) / 2, " tokens returned for ", own);
  return {dq.to(q.scalar_type()), dkv.narrow(0, 0, own).to(k.scalar_type()),
          dkv.narrow(0, own, own).to(v.scalar_type())};
}

// All N ring positions of one ring run in sequence in ONE process on full (unsharded) tensors:
// position i's queries meet the K/V blocks of positions i, i-1, ... exactly as in the real ring,
// through the same blockForward + mergeInto code. Lets one device (one GPU) exercise and time the
// multi-step ring computation. Returns (out, lse) in shard order (position 0's tokens, then 1's...).
std::tuple<at::Tensor, at::Tensor> virtualRingFwd(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, c10::IntArrayRef doc_lens,
                                                  int64_t n, bool causal, double scale) {
  auto lens = checkedLens(doc_lens, "virtual ring attention");
  TORCH_CHECK(n >= 1, "bytescale virtual ring attention: ring size must be >= 1, got ", n);
  const double sc = resolveScale(scale, q);
  std::vector<int64_t> offs(lens.size() + 1, 0);
  for (size_t d = 0; d < lens.size(); ++d) offs[d + 1] = offs[d] + lens[d];
  TORCH_CHECK(offs.back() == q.size(0), "bytescale virtual ring attention: document lengths sum to ",
              offs.back(), " but q has ", q.size(0), " tokens");
  std::vector<TokenMeta> metas;
  std::vector<at::Tensor> idx;
  for (int64_t i = 0; i < n; ++i) {
    metas.push_back(shardMeta(lens, n, i));
    at::Tensor ix = metas.back().pos.clone();
    auto* p = ix.data_ptr<int64_t>();
    const auto* d = metas.back().doc.data_ptr<int64_t>();
    for (int64_t t = 0; t < ix.numel(); ++t) p[t] += offs[d[t]];
    idx.push_back(ix.to(q.device()));
  }
  const auto acc = accType(q.scalar_type());
  std::vector<at::Tensor> outs, lses;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor qi = q.index_select(0, idx[i]);
    at::Tensor out = at::zeros({qi.size(0), q.size(1), q.size(2)}, q.options().dtype(acc));
    at::Tensor lse = at::full({q.size(1), qi.size(0)}, -std::numeric_limits<double>::infinity(),
                              q.options().dtype(acc));
    for (int64_t st = 0; st < n; ++st) {
      const int64_t src = mod(i - st, n);
      auto [ob, lb] = blockForward(qi, k.index_select(0, idx[src]), v.index_select(0, idx[src]),
                                   metas[i], metas[src], causal, sc);
      mergeInto(out, lse, ob, lb);
    }
    outs.push_back(out.to(q.scalar_type()));
    lses.push_back(lse);
  }
  return {at::cat(outs, 0), at::cat(lses, 1)};
}

TORCH_LIBRARY(bytescale, m) {
  m.def("varlen_attn_fwd(Tensor q, Tensor k, Tensor v, int[] doc_lens, bool causal, float scale)"
        " -> (Tensor, Tensor)");
  m.def("varlen_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "int[] doc_lens, bool causal, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("ring_attn_fwd(Tensor q, Tensor k, Tensor v, int[] doc_lens, int[] ranks, bool causal, "
        "float scale) -> (Tensor, Tensor)");
  m.def("ring_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "int[] doc_lens, int[] ranks, bool causal, float scale, bool bf16_grad_comm) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("virtual_ring_attn_fwd(Tensor q, Tensor k, Tensor v, int[] doc_lens, int n, bool causal, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(bytescale, CompositeExplicitAutograd, m) {
  m.impl("varlen_attn_fwd", &varlenFwd);
  m.impl("varlen_attn_bwd", &varlenBwd);
  m.impl("ring_attn_fwd", &ringFwd);
  m.impl("ring_attn_bwd", &ringBwd);
  m.impl("virtual_ring_attn_fwd", &virtualRingFwd);
}

}  // namespace attention
}  // namespace bytescale
