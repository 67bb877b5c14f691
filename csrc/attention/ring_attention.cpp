// Ring attention and local varlen attention as torch custom ops (TORCH_LIBRARY "bytescale").
//
//   bytescale::varlen_attn_fwd / _bwd : packed documents that are wholly local (no communication).
//   bytescale::ring_attn_fwd  / _bwd  : packed documents sharded zig-zag over a ring of global
//                                        ranks (csrc/common/zigzag.h), any lengths.
//
// Before any K/V moves, the members check that they agree on the call (ring_agreement.h; on by
// default, BYTESCALE_CHECK_RING=0 turns it off).
// The ring runs over the world Transport of the tensors' device (comm/transport.h), so the same
// code runs on Gloo (CPU) and NCCL (CUDA). Forward: at step s rank i attends its queries to the
// K/V block of ring position (i - s) while the next block is already in flight (ringStep), and
// merges the partial result into fp32 accumulators through the log-sum-exp. Backward: dQ
// accumulates locally; each K/V block travels the ring again together with its dK/dV accumulator
// (fp32 by default, bf16 on request), every member adding its contribution; after N hops the
// accumulator is back at its owner. Both the K/V blocks and the accumulators are in flight while
// the current block is computed.
//
// Autograd and fake (meta) kernels are registered from Python (bytescale/ring.py) with
// torch.library, so torch.compile can trace models using these ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <exception>
#include <limits>
#include <optional>
#include <string>

#include "attention/block_attention.h"
#include "attention/block_step.h"
#include "attention/ring_agreement.h"
#include "common/zigzag.h"
#include "comm/agreement.h"
#include "comm/schedule.h"
#include "comm/traffic.h"
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

// Every op's inputs, checked once at entry on any device (the kernels assume them).
void checkQKV(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* what,
              const at::Tensor& dout = at::Tensor()) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "bytescale ", what,
              ": q, k, v must be (tokens, heads, head_dim), got q ", q.sizes(), ", k ", k.sizes(),
              ", v ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "bytescale ", what, ": k ", k.sizes(), " and v ", v.sizes(),
              " differ in shape");
  TORCH_CHECK(q.size(0) == k.size(0), "bytescale ", what, ": q has ", q.size(0), " tokens but k has ",
              k.size(0));
  TORCH_CHECK(q.size(2) == k.size(2), "bytescale ", what, ": head_dim of q (", q.size(2),
              ") != head_dim of k and v (", k.size(2), ")");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "bytescale ", what, ": ", q.size(1),
              " query heads is not a multiple of ", k.size(1), " kv heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "bytescale ", what, ": q, k, v dtypes differ (", q.scalar_type(), ", ", k.scalar_type(),
              ", ", v.scalar_type(), ")");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "bytescale ", what,
              ": floating-point q, k, v needed, got ", q.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "bytescale ", what,
              ": q, k, v on different devices (", q.device(), ", ", k.device(), ", ", v.device(), ")");
  if (dout.defined())
    TORCH_CHECK(dout.sizes() == q.sizes() && dout.device() == q.device(), "bytescale ", what,
                ": the output gradient ", dout.sizes(), " on ", dout.device(), " does not match q ",
                q.sizes(), " on ", q.device());
}

double resolveScale(double scale, const at::Tensor& q) {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
}

// The ring: its group as the rank map dynamic groups use (comm::RankMap: ordered, distinct global
// ranks; ring position = group rank), and the world transport of the tensors' device.
struct Ring {
  std::optional<comm::RankMap> group;
  std::shared_ptr<comm::Transport> tr;  // null only for a ring of one outside a bytescale world
  std::string what;

  int64_t n() const { return group->size(); }
  int64_t me() const { return group->myIndex(); }
};

Ring makeRing(c10::IntArrayRef ranks, const at::Tensor& q, const char* op) {
  Ring r;
  std::vector<int> members;
  std::string desc = "[";
  for (size_t k = 0; k < ranks.size(); ++k) {
    desc += (k ? ", " : "") + std::to_string(ranks[k]);
    TORCH_CHECK(ranks[k] >= 0 && ranks[k] <= std::numeric_limits<int>::max(), "bytescale ", op,
                ": rank ", ranks[k], " in ring ", ranks, " is not a rank");
    members.push_back(static_cast<int>(ranks[k]));
  }
  r.what = std::string(op) + " on ring " + desc + "]";
  TORCH_CHECK(!members.empty(), "bytescale ", op, ": empty ring");
  r.tr = comm::worldTransport(q.device().type());
  TORCH_CHECK(r.tr || members.size() == 1, "bytescale ", r.what, ": no bytescale transport for ",
              q.device(), " tensors; call dist.init_process_group(\"bytescale\") first");
  // A ring of one outside a bytescale world needs no transport: it is its own world.
  const int world = r.tr ? r.tr->worldSize() : members[0] + 1;
  const int me = r.tr ? r.tr->rank() : members[0];
  try {
    r.group.emplace(std::move(members), world, me);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "bytescale ", r.what, ": ", e.what());
  }
  TORCH_CHECK(r.group->isMember(), "bytescale ", r.what, ": rank ", me,
              " is not a member of the ring");
  return r;
}

int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

// Waits for a ring exchange, adding the time blocked to the traffic counters (comm/traffic.h).
void timedWait(comm::PendingExchange& p) {
  const auto t0 = std::chrono::steady_clock::now();
  p.wait();
  comm::countRingWait(std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - t0).count());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> varlenFwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, c10::IntArrayRef doc_lens,
                                             bool causal, double scale) {
  checkQKV(q, k, v, "varlen attention");
  auto lens = checkedLens(doc_lens, "varlen attention");
  int64_t total = 0;
  for (auto n : lens) total += n;
  TORCH_CHECK(total == q.size(0) && k.size(0) == q.size(0), "bytescale varlen attention: "
              "document lengths sum to ", total, " but q has ", q.size(0), " and k ", k.size(0),
              " tokens");
  return attendOnce(q, k, v, BlockPair{lens, 0, 0, 0, causal}, resolveScale(scale, q));
}

namespace {

// Gradient accumulators in the accumulation dtype.
at::Tensor zerosAcc(const at::Tensor& like) {
  return at::zeros(like.sizes(), like.options().dtype(accType(like.scalar_type())));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlenBwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef doc_lens, bool causal,
    double scale) {
  checkQKV(q, k, v, "varlen attention backward", dout);
  auto lens = checkedLens(doc_lens, "varlen attention backward");
  at::Tensor dq = zerosAcc(q), dk = zerosAcc(k), dv = zerosAcc(v), delta;
  backwardStep(dout, q, k, v, out, lse, delta, BlockPair{lens, 0, 0, 0, causal},
               resolveScale(scale, q), dq, dk, dv);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

namespace {

// This member's view of a ring call for the agreement check (ring_agreement.h); shape fields stay
// -1 when the tensors are too malformed to read them.
RingView viewOf(const at::Tensor& q, const at::Tensor& k, c10::IntArrayRef doc_lens,
                c10::IntArrayRef ranks, bool causal, double scale, bool bf16_grad_comm) {
  RingView v;
  v.doc_lens.assign(doc_lens.begin(), doc_lens.end());
  v.ranks.assign(ranks.begin(), ranks.end());
  v.dtype = static_cast<int64_t>(q.scalar_type());
  if (q.dim() == 3) {
    v.q_heads = q.size(1);
    v.head_dim = q.size(2);
    v.scale = resolveScale(scale, q);
  }
  if (k.dim() == 3) v.kv_heads = k.size(1);
  v.causal = causal;
  v.bf16_grad_comm = bf16_grad_comm;
  return v;
}

// The transport the agreement check runs on: the host channel of the world's CPU (Gloo) transport
// when there is one (comm/agreement.h: a CUDA ring's check needs no device synchronisation and
// never waits behind the NCCL stream; in NCCL-order mode never behind the in-order queue); else
// the ring's own.
std::shared_ptr<comm::Transport> checkTransport(const Ring& ring) {
  auto host = comm::hostChannel();
  return host ? host : ring.tr;
}

}  // namespace

// bf16_grad_comm is the backward's (ring_attn_bwd): the forward takes it so that autograd's
// setup_context finds it among the op's inputs (and the agreement check covers it).
std::tuple<at::Tensor, at::Tensor> ringFwd(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, c10::IntArrayRef doc_lens,
                                           c10::IntArrayRef ranks, bool causal, double scale,
                                           bool bf16_grad_comm) {
  Ring ring = makeRing(ranks, q, "ring attention");
  const int64_t n = ring.n(), me = ring.me();
  // This member's own input checks. With the agreement check on, a failure is first told to the
  // other members (who would otherwise wait for its K/V until the timeout), then raised here.
  std::vector<int64_t> lens;
  std::exception_ptr local_error;
  std::string local_message;
  try {
    checkQKV(q, k, v, "ring attention");
    lens = checkedLens(doc_lens, "ring attention");
    const int64_t mine = zigzag::shard_tokens(lens, n, me);
    TORCH_CHECK(mine == q.size(0) && k.size(0) == q.size(0), "bytescale ", ring.what,
                ": ring position ", me, " of ", n, " holds ", mine,
                " tokens of documents ", doc_lens, " but q has ", q.size(0), " and k ", k.size(0));
  } catch (const c10::Error& e) {
    local_error = std::current_exception();
    local_message = e.what_without_backtrace();
  }
  // Ring agreement: every member checks that all describe the same call (documents, ring order,
  // dtype, head shapes, causal, scale, bf16 dK/dV traffic) before any K/V moves; a mismatch
  // raises on every member naming both views. The backward (ringBwd) relies on this check: autograd
  // calls it with the forward's very arguments, so it does not repeat the exchange.
  // Inside an agreement scope (a micro-batch) a call already agreed on is not exchanged again
  // (later layers, the activation-checkpoint recompute).
  if (n > 1 && ringChecksEnabled()) {
    RingView view = viewOf(q, k, doc_lens, ranks, causal, scale, bf16_grad_comm);
    view.error = local_message;
    if (!agreedInScope(view)) {
      checkRingAgreement(*checkTransport(ring), *ring.group, view, ring.what);
      agreedInScope(view, /*remember=*/true);
    }
  }
  if (local_error) std::rethrow_exception(local_error);
  const double sc = resolveScale(scale, q);
  if (n == 1) return attendOnce(q, k, v, BlockPair{lens, 1, 0, 0, causal}, sc);
  const auto acc = accType(q.scalar_type());
  at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2)}, q.options().dtype(acc));
  at::Tensor lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc));
  at::Tensor cur = at::cat({k, v}, 0).contiguous();  // (2T, Hkv, D): one message per step
  int64_t src = me;
  const int next = ring.group->next(), prev = ring.group->prev();
  for (int64_t s = 0; s < n; ++s) {
    std::unique_ptr<comm::PendingExchange> pending;
    at::Tensor buf;
    int64_t nsrc = mod(me - s - 1, n);
    if (s + 1 < n) {
      buf = at::empty({2 * zigzag::shard_tokens(lens, n, nsrc), k.size(1), k.size(2)}, k.options());
      comm::TrafficScope scope(comm::Traffic::kRingKvFwd);
      pending = ring.tr->ringStep(cur, next, buf, prev, ring.what);
    }
    const int64_t t = cur.size(0) / 2;
    forwardStep(q, cur.narrow(0, 0, t), cur.narrow(0, t, t), BlockPair{lens, n, me, src, causal},
                sc, out, lse);
    if (pending) {
      timedWait(*pending);
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
  // No ring agreement exchange here: autograd calls the backward with the forward's own
  // arguments, which the forward's check (ringFwd) already found identical on every member.
  checkQKV(q, k, v, "ring attention backward", dout);
  auto lens = checkedLens(doc_lens, "ring attention backward");
  Ring ring = makeRing(ranks, q, "ring attention backward");
  const int64_t n = ring.n(), me = ring.me();
  const double sc = resolveScale(scale, q);
  at::Tensor delta;
  at::Tensor dq = zerosAcc(q);
  if (n == 1) {
    at::Tensor dk = zerosAcc(k), dv = zerosAcc(v);
    backwardStep(dout, q, k, v, out, lse, delta, BlockPair{lens, 1, 0, 0, causal}, sc, dq, dk, dv);
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
  }
  const auto acc = accType(q.scalar_type());
  const auto comm_dt = bf16_grad_comm && acc == at::kFloat ? at::kBFloat16 : acc;
  at::Tensor cur = at::cat({k, v}, 0).contiguous();
  int64_t src = me;
  const int next = ring.group->next(), prev = ring.group->prev();
  // The dK/dV accumulator of the block in hand travels one hop per step. It is in flight while
  // this rank computes the block's contribution into a fresh buffer, and is added on arrival, so
  // the accumulator traffic overlaps compute like the K/V traffic does.
  std::unique_ptr<comm::PendingExchange> pending_acc;
  at::Tensor acc_send, acc_recv;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t nsrc = mod(me - s - 1, n);
    const int64_t nt = zigzag::shard_tokens(lens, n, nsrc);
    std::unique_ptr<comm::PendingExchange> pending_kv;
    at::Tensor kv_buf;
    if (s + 1 < n) {
      kv_buf = at::empty({2 * nt, k.size(1), k.size(2)}, k.options());
      comm::TrafficScope scope(comm::Traffic::kRingKvBwd);
      pending_kv = ring.tr->ringStep(cur, next, kv_buf, prev, ring.what);
    }
    const int64_t t = cur.size(0) / 2;
    at::Tensor part = at::zeros({2 * t, k.size(1), k.size(2)}, q.options().dtype(acc));
    at::Tensor dk = part.narrow(0, 0, t), dv = part.narrow(0, t, t);
    backwardStep(dout, q, cur.narrow(0, 0, t), cur.narrow(0, t, t), out, lse, delta,
                 BlockPair{lens, n, me, src, causal}, sc, dq, dk, dv);
    if (pending_acc) {  // block src's accumulator, sent by the previous rank one step ago
      timedWait(*pending_acc);
      part.add_(acc_recv);
    }
    // Pass it on; the next block's accumulator arrives from prev. After N hops it is home.
    acc_send = comm_dt == acc ? part : part.to(comm_dt);
    acc_recv = at::empty({2 * nt, k.size(1), k.size(2)}, q.options().dtype(comm_dt));
    {
      comm::TrafficScope scope(comm::Traffic::kRingDkvBwd);
      pending_acc = ring.tr->ringStep(acc_send, next, acc_recv, prev, ring.what + " (dK/dV)");
    }
    if (pending_kv) {
      timedWait(*pending_kv);
      cur = kv_buf;
      src = nsrc;
    }
  }
  timedWait(*pending_acc);
  at::Tensor dkv = acc_recv.to(acc);
  const int64_t own = k.size(0);
  TORCH_CHECK(dkv.size(0) == 2 * own, "bytescale ", ring.what, ": internal error, dK/dV of ",
              dkv.size(0) / 2, " tokens returned for ", own);
  return {dq.to(q.scalar_type()), dkv.narrow(0, 0, own).to(k.scalar_type()),
          dkv.narrow(0, own, own).to(v.scalar_type())};
}

// All N ring positions of one ring run in sequence in ONE process: position i's queries meet the
// K/V blocks of positions i, i-1, ... exactly as in the real ring, through the same step code
// (forwardStep / backwardStep) the real ring runs, minus the communication. Lets one device (one
// GPU) exercise and time the multi-step ring computation. Inputs and outputs are in shard order
// (position 0's tokens, then position 1's, ...; bytescale.ring.shard gives each part).
namespace {

std::vector<int64_t> shardOffsets(const std::vector<int64_t>& lens, int64_t n, const at::Tensor& q,
                                  const char* what) {
  TORCH_CHECK(n >= 1, "bytescale ", what, ": ring size must be >= 1, got ", n);
  std::vector<int64_t> offs(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) offs[i + 1] = offs[i] + zigzag::shard_tokens(lens, n, i);
  TORCH_CHECK(offs.back() == q.size(0), "bytescale ", what, ": document lengths sum to ",
              offs.back(), " but q has ", q.size(0), " tokens");
  return offs;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> virtualRingFwd(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, c10::IntArrayRef doc_lens,
                                                  int64_t n, bool causal, double scale) {
  const char* what = "virtual ring attention";
  checkQKV(q, k, v, what);
  auto lens = checkedLens(doc_lens, what);
  auto offs = shardOffsets(lens, n, q, what);
  const double sc = resolveScale(scale, q);
  const auto acc = accType(q.scalar_type());
  at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2)}, q.options().dtype(acc));
  at::Tensor lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = offs[i], len = offs[i + 1] - offs[i];
    at::Tensor qi = q.narrow(0, a, len);
    at::Tensor oi = out.narrow(0, a, len);
    at::Tensor li = lse.narrow(1, a, len).contiguous();
    for (int64_t st = 0; st < n; ++st) {
      const int64_t src = mod(i - st, n), b = offs[src], kl = offs[src + 1] - offs[src];
      forwardStep(qi, k.narrow(0, b, kl), v.narrow(0, b, kl), BlockPair{lens, n, i, src, causal}, sc,
                  oi, li);
    }
    lse.narrow(1, a, len).copy_(li);
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> virtualRingBwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef doc_lens, int64_t n, bool causal,
    double scale) {
  const char* what = "virtual ring attention backward";
  checkQKV(q, k, v, what, dout);
  auto lens = checkedLens(doc_lens, what);
  auto offs = shardOffsets(lens, n, q, what);
  const double sc = resolveScale(scale, q);
  at::Tensor dq = zerosAcc(q), dk = zerosAcc(k), dv = zerosAcc(v);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = offs[i], len = offs[i + 1] - offs[i];
    at::Tensor qi = q.narrow(0, a, len), doi = dout.narrow(0, a, len), oi = out.narrow(0, a, len);
    at::Tensor li = lse.narrow(1, a, len).contiguous();
    at::Tensor dqi = dq.narrow(0, a, len), delta;
    for (int64_t st = 0; st < n; ++st) {
      const int64_t src = mod(i - st, n), b = offs[src], kl = offs[src + 1] - offs[src];
      at::Tensor dki = dk.narrow(0, b, kl), dvi = dv.narrow(0, b, kl);
      backwardStep(doi, qi, k.narrow(0, b, kl), v.narrow(0, b, kl), oi, li, delta,
                   BlockPair{lens, n, i, src, causal}, sc, dqi, dki, dvi);
    }
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

// merge_lse_ on the CPU: out (T, H, D) and lse (H, T) in fp32/fp64, out_b (T, H, D), lse_b (H, T).
void mergeLseCpu(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b, const at::Tensor& lse_b) {
  TORCH_CHECK(out.dim() == 3 && out_b.sizes() == out.sizes() && lse.dim() == 2 &&
                  lse.size(0) == out.size(1) && lse.size(1) == out.size(0) &&
                  lse_b.sizes() == lse.sizes(),
              "bytescale merge_lse_: out (T, H, D) ", out.sizes(), ", lse (H, T) ", lse.sizes(),
              ", out_b ", out_b.sizes(), ", lse_b ", lse_b.sizes(), " do not match");
  TORCH_CHECK(at::isFloatingType(out.scalar_type()) && lse.scalar_type() == out.scalar_type(),
              "bytescale merge_lse_: out and lse must share a floating dtype, got ",
              out.scalar_type(), " and ", lse.scalar_type());
  const at::Tensor valid = at::isfinite(lse_b);
  at::Tensor lb = at::where(valid, lse_b.to(lse.scalar_type()),
                            at::full({}, -std::numeric_limits<double>::infinity(), lse.options()));
  at::Tensor o = out.clone(), l = lse.clone();
  mergeInto(o, l, out_b.to(out.scalar_type()), lb);
  out.copy_(at::where(valid.transpose(0, 1).unsqueeze(-1), o, out));
  lse.copy_(at::where(valid, l, lse));
}

TORCH_LIBRARY(bytescale, m) {
  m.def("varlen_attn_fwd(Tensor q, Tensor k, Tensor v, int[] doc_lens, bool causal, float scale)"
        " -> (Tensor, Tensor)");
  m.def("varlen_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "int[] doc_lens, bool causal, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("ring_attn_fwd(Tensor q, Tensor k, Tensor v, int[] doc_lens, int[] ranks, bool causal, "
        "float scale, bool bf16_grad_comm=False) -> (Tensor, Tensor)");
  m.def("ring_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "int[] doc_lens, int[] ranks, bool causal, float scale, bool bf16_grad_comm) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("virtual_ring_attn_fwd(Tensor q, Tensor k, Tensor v, int[] doc_lens, int n, bool causal, "
        "float scale) -> (Tensor, Tensor)");
  m.def("virtual_ring_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "int[] doc_lens, int n, bool causal, float scale) -> (Tensor, Tensor, Tensor)");
  // In-place log-sum-exp merge of one block's (out_b, lse_b) into running (out, lse); rows whose
  // lse_b is not finite (the block gave them nothing) stay unchanged. Kernels: CPU below, CUDA
  // from the CUDA plug-in (csrc/cuda/attention/).
  m.def("merge_lse_(Tensor(a!) out, Tensor(b!) lse, Tensor out_b, Tensor lse_b) -> ()");
}

TORCH_LIBRARY_IMPL(bytescale, CPU, m) { m.impl("merge_lse_", &mergeLseCpu); }

TORCH_LIBRARY_IMPL(bytescale, CompositeExplicitAutograd, m) {
  m.impl("varlen_attn_fwd", &varlenFwd);
  m.impl("varlen_attn_bwd", &varlenBwd);
  m.impl("ring_attn_fwd", &ringFwd);
  m.impl("ring_attn_bwd", &ringBwd);
  m.impl("virtual_ring_attn_fwd", &virtualRingFwd);
  m.impl("virtual_ring_attn_bwd", &virtualRingBwd);
}

}  // namespace attention
}  // namespace bytescale
