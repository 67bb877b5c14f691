#include "comm/group_ops.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "comm/consistency.h"

namespace bytescale {
namespace comm {
namespace group_ops {

namespace {

using RedOp = c10d::ReduceOp::RedOpType;

// Below this many bytes an all-reduce gathers whole tensors (one ring pass of small messages)
// instead of reduce-scatter + all-gather (two passes).
constexpr int64_t kSmallAllReduceBytes = 64 * 1024;

at::Tensor block(const at::Tensor& flat, int64_t total, int n, int j) {
  int64_t s = blockStart(total, n, j), e = blockStart(total, n, j + 1);
  return flat.narrow(0, s, e - s);
}

void combine(const at::Tensor& dst, const at::Tensor& src, RedOp op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
    case c10d::ReduceOp::PREMUL_SUM:
      if (dst.scalar_type() == at::kBool)
        dst.logical_or_(src);
      else
        dst.add_(src);
      break;
    case c10d::ReduceOp::PRODUCT:
      if (dst.scalar_type() == at::kBool)
        dst.logical_and_(src);
      else
        dst.mul_(src);
      break;
    case c10d::ReduceOp::MIN:
      at::minimum_out(const_cast<at::Tensor&>(dst), dst, src);
      break;
    case c10d::ReduceOp::MAX:
      at::maximum_out(const_cast<at::Tensor&>(dst), dst, src);
      break;
    case c10d::ReduceOp::BAND:
      dst.bitwise_and_(src);
      break;
    case c10d::ReduceOp::BOR:
      dst.bitwise_or_(src);
      break;
    case c10d::ReduceOp::BXOR:
      dst.bitwise_xor_(src);
      break;
    default:
      TORCH_CHECK(false, "bytescale: unsupported reduce op ", static_cast<int>(op));
  }
}

// PREMUL_SUM multiplies every contribution by a factor before summing.
void premultiply(const at::Tensor& t, const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return;
  auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(sup, "bytescale: PREMUL_SUM without a factor");
  if (sup->tensor_factor.defined())
    t.mul_(sup->tensor_factor.to(t.device(), t.scalar_type()));
  else
    t.mul_(sup->double_factor);
}

void finish(const at::Tensor& t, const c10d::ReduceOp& op, int n) {
  if (op.op_ == c10d::ReduceOp::AVG) t.div_(n);
}

at::Tensor contiguousOrSame(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

void waitStep(Transport& tr, const at::Tensor& send, int next, const at::Tensor& recv, int prev,
              const std::string& what) {
  tr.ringStep(send, next, recv, prev, what)->wait();
}

}  // namespace

void allGather(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
               const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  const int64_t m = in.numel();
  at::Tensor o = contiguousOrSame(out);
  at::Tensor f = o.view(-1);
  f.narrow(0, i * m, m).copy_(in.reshape(-1));
  for (const auto& st : ringAllGatherSchedule(n, i))
    waitStep(tr, f.narrow(0, st.send_block * m, m), g.next(), f.narrow(0, st.recv_block * m, m),
             g.prev(), what);
  if (!o.is_same(out)) out.copy_(o);
}

void reduceScatter(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
                   const c10d::ReduceOp& op, const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  const int64_t m = out.numel();
  at::Tensor buf = in.reshape(-1).clone();
  premultiply(buf, op);
  at::Tensor tmp = at::empty({m}, buf.options());
  for (const auto& st : ringReduceScatterSchedule(n, i)) {
    waitStep(tr, buf.narrow(0, st.send_block * m, m), g.next(), tmp, g.prev(), what);
    combine(buf.narrow(0, st.recv_block * m, m), tmp, op.op_);
  }
  at::Tensor mine = buf.narrow(0, i * m, m);
  finish(mine, op, n);
  out.copy_(mine.view(out.sizes()));
}

void allReduce(Transport& tr, const RankMap& g, const at::Tensor& t, const c10d::ReduceOp& op,
               const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  const int64_t total = t.numel();
  at::Tensor w = contiguousOrSame(t);
  at::Tensor f = w.view(-1);
  if (n == 1 || total == 0) {
    premultiply(f, op);
    finish(f, op, n);
  } else if (total < n || total * t.element_size() <= kSmallAllReduceBytes) {
    at::Tensor gathered = at::empty({n, total}, f.options());
    allGather(tr, g, gathered, f, what);
    premultiply(gathered, op);
    at::Tensor acc = gathered[0].clone();
    for (int j = 1; j < n; ++j) combine(acc, gathered[j], op.op_);
    finish(acc, op, n);
    f.copy_(acc);
  } else {
    premultiply(f, op);
    at::Tensor tmp = at::empty({(total + n - 1) / n + 1}, f.options());
    for (const auto& st : ringReduceScatterSchedule(n, i)) {
      at::Tensor rb = block(f, total, n, st.recv_block);
      at::Tensor rt = tmp.narrow(0, 0, rb.numel());
      waitStep(tr, block(f, total, n, st.send_block), g.next(), rt, g.prev(), what);
      combine(rb, rt, op.op_);
    }
    finish(block(f, total, n, i), op, n);
    for (const auto& st : ringAllGatherSchedule(n, i))
      waitStep(tr, block(f, total, n, st.send_block), g.next(), block(f, total, n, st.recv_block),
               g.prev(), what);
  }
  if (!w.is_same(t)) t.copy_(w);
}

void broadcast(Transport& tr, const RankMap& g, const at::Tensor& t, int root,
               const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  if (n == 1 || t.numel() == 0) return;
  at::Tensor w = contiguousOrSame(t);
  at::Tensor f = w.view(-1);
  const int64_t total = f.numel();
  const int chunks = pipelineChunks(total * f.element_size());
  const int rel = (i - root + n) % n;
  auto chunk = [&](int c) { return block(f, total, chunks, c); };
  if (rel == 0) {
    std::vector<P2POp> ops;
    for (int c = 0; c < chunks; ++c) ops.push_back({P2POp::kSend, g.next(), chunk(c)});
    tr.countPeers(ops);
    tr.exchange(ops, what)->wait();
  } else if (rel == n - 1) {
    std::vector<P2POp> ops;
    for (int c = 0; c < chunks; ++c) ops.push_back({P2POp::kRecv, g.prev(), chunk(c)});
    tr.countPeers(ops);
    tr.exchange(ops, what)->wait();
  } else {
    countPeer(&tr, g.prev());
    countPeer(&tr, g.next());
    tr.exchange({{P2POp::kRecv, g.prev(), chunk(0)}}, what)->wait();
    for (int c = 0; c < chunks; ++c) {
      std::vector<P2POp> ops{{P2POp::kSend, g.next(), chunk(c)}};
      if (c + 1 < chunks) ops.push_back({P2POp::kRecv, g.prev(), chunk(c + 1)});
      tr.exchange(ops, what)->wait();
    }
  }
  if (!w.is_same(t)) t.copy_(w);
}

void allToAll(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
              const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits,
              const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  at::Tensor ic = contiguousOrSame(in);
  at::Tensor oc = contiguousOrSame(out);
  std::vector<int64_t> ioff(n + 1, 0), ooff(n + 1, 0);
  for (int j = 0; j < n; ++j) {
    ioff[j + 1] = ioff[j] + in_splits[j];
    ooff[j + 1] = ooff[j] + out_splits[j];
  }
  oc.narrow(0, ooff[i], out_splits[i]).copy_(ic.narrow(0, ioff[i], in_splits[i]));
  std::vector<P2POp> ops;
  for (const auto& st : pairwiseSchedule(n, i)) {
    ops.push_back({P2POp::kSend, g.globalRank(st.send_to),
                   ic.narrow(0, ioff[st.send_to], in_splits[st.send_to])});
    ops.push_back({P2POp::kRecv, g.globalRank(st.recv_from),
                   oc.narrow(0, ooff[st.recv_from], out_splits[st.recv_from])});
  }
  tr.exchange(ops, what)->wait();
  if (!oc.is_same(out)) out.copy_(oc);
}

void allToAllList(Transport& tr, const RankMap& g, const std::vector<at::Tensor>& outputs,
                  const std::vector<at::Tensor>& inputs, const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  outputs[i].copy_(inputs[i].view(outputs[i].sizes()));
  std::vector<P2POp> ops;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  for (const auto& st : pairwiseSchedule(n, i)) {
    ops.push_back({P2POp::kSend, g.globalRank(st.send_to), inputs[st.send_to].contiguous()});
    at::Tensor o = outputs[st.recv_from];
    at::Tensor oc = contiguousOrSame(o);
    if (!oc.is_same(o)) copies.emplace_back(o, oc);
    ops.push_back({P2POp::kRecv, g.globalRank(st.recv_from), oc});
  }
  tr.exchange(ops, what)->wait();
  for (auto& c : copies) c.first.copy_(c.second);
}

void gather(Transport& tr, const RankMap& g, const std::vector<at::Tensor>& outputs,
            const at::Tensor& in, int root, const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  if (i != root) {
    tr.exchange({{P2POp::kSend, g.globalRank(root), contiguousOrSame(in)}}, what)->wait();
    return;
  }
  std::vector<at::Tensor> bufs(n);
  std::vector<P2POp> ops;
  for (int j = 0; j < n; ++j) {
    if (j == i) {
      outputs[j].copy_(in.view(outputs[j].sizes()));
      continue;
    }
    bufs[j] = contiguousOrSame(outputs[j]);
    ops.push_back({P2POp::kRecv, g.globalRank(j), bufs[j]});
  }
  tr.exchange(ops, what)->wait();
  for (int j = 0; j < n; ++j)
    if (j != i && !bufs[j].is_same(outputs[j])) outputs[j].copy_(bufs[j]);
}

void scatter(Transport& tr, const RankMap& g, const at::Tensor& out,
             const std::vector<at::Tensor>& inputs, int root, const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  if (i != root) {
    at::Tensor o = contiguousOrSame(out);
    tr.exchange({{P2POp::kRecv, g.globalRank(root), o}}, what)->wait();
    if (!o.is_same(out)) out.copy_(o);
    return;
  }
  std::vector<P2POp> ops;
  for (int j = 0; j < n; ++j) {
    if (j == i)
      out.copy_(inputs[j].view(out.sizes()));
    else
      ops.push_back({P2POp::kSend, g.globalRank(j), contiguousOrSame(inputs[j])});
  }
  tr.exchange(ops, what)->wait();
}

void reduce(Transport& tr, const RankMap& g, const at::Tensor& t, const c10d::ReduceOp& op,
            int root, const std::string& what) {
  const int n = g.size(), i = g.myIndex();
  if (i != root) {
    tr.exchange({{P2POp::kSend, g.globalRank(root), contiguousOrSame(t)}}, what)->wait();
    return;
  }
  at::Tensor parts = at::empty({n, t.numel()}, t.options());
  std::vector<P2POp> ops;
  for (int j = 0; j < n; ++j) {
    if (j == i)
      parts[j].copy_(t.reshape(-1));
    else
      ops.push_back({P2POp::kRecv, g.globalRank(j), parts[j]});
  }
  tr.exchange(ops, what)->wait();
  premultiply(parts, op);
  at::Tensor acc = parts[0].clone();
  for (int j = 1; j < n; ++j) combine(acc, parts[j], op.op_);
  finish(acc, op, n);
  t.copy_(acc.view(t.sizes()));
}

void barrier(Transport& tr, const RankMap& g, const std::string& what) {
  at::Tensor token = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(tr.deviceType()));
  allReduce(tr, g, token, c10d::ReduceOp(c10d::ReduceOp::SUM), what);
}

void run(Transport& tr, const RankMap& g, const Collective& c) {
  checkConsistent(tr, g, c);
  const int n = g.size();
  const std::string& what = c.what;
  switch (c.kind) {
    case CollectiveKind::kBroadcast:
      for (const auto& t : c.inputs) broadcast(tr, g, t, c.root, what);
      return;
    case CollectiveKind::kAllReduce:
      for (const auto& t : c.inputs) allReduce(tr, g, t, c.op, what);
      return;
    case CollectiveKind::kReduce:
      for (const auto& t : c.inputs) reduce(tr, g, t, c.op, c.root, what);
      return;
    case CollectiveKind::kAllGather:
      for (size_t k = 0; k < c.inputs.size(); ++k) {
        const at::Tensor& in = c.inputs[k];
        at::Tensor buf = at::empty({n * in.numel()}, in.options());
        allGather(tr, g, buf, in, what);
        auto parts = buf.view({n, -1});
        for (int j = 0; j < n; ++j) {
          const at::Tensor& o = c.outputs[k * n + j];
          o.copy_(parts[j].view(o.sizes()));
        }
      }
      return;
    case CollectiveKind::kAllGatherInto:
      for (size_t k = 0; k < c.inputs.size(); ++k) allGather(tr, g, c.outputs[k], c.inputs[k], what);
      return;
    case CollectiveKind::kGather:
      gather(tr, g, c.outputs, c.inputs[0], c.root, what);
      return;
    case CollectiveKind::kScatter:
      scatter(tr, g, c.outputs[0], c.inputs, c.root, what);
      return;
    case CollectiveKind::kReduceScatter:
      for (size_t k = 0; k < c.outputs.size(); ++k) {
        std::vector<at::Tensor> flat;
        for (int j = 0; j < n; ++j) flat.push_back(c.inputs[k * n + j].reshape(-1));
        reduceScatter(tr, g, c.outputs[k], at::cat(flat), c.op, what);
      }
      return;
    case CollectiveKind::kReduceScatterFrom:
      for (size_t k = 0; k < c.outputs.size(); ++k)
        reduceScatter(tr, g, c.outputs[k], c.inputs[k], c.op, what);
      return;
    case CollectiveKind::kAllToAll:
      allToAll(tr, g, c.outputs[0], c.inputs[0], c.out_splits, c.in_splits, what);
      return;
    case CollectiveKind::kAllToAllList:
      allToAllList(tr, g, c.outputs, c.inputs, what);
      return;
    case CollectiveKind::kBarrier:
      barrier(tr, g, what);
      return;
  }
}

}  // namespace group_ops
}  // namespace comm
}  // namespace bytescale
