#include "comm/group_ops.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <numeric>
#include <sstream>

namespace bytescale {
namespace comm {
namespace group_ops {

namespace {

using RedOp = c10d::ReduceOp::RedOpType;

// Below this many bytes an all-reduce gathers whole tensors (one ring pass of small messages)
// instead of reduce-scatter + all-gather (two passes).
constexpr int64_t kSmallAllReduceBytes = 64 * 1024;
// Groups up to this size exchange consistency fingerprints all-to-all in one round trip; larger
// ones use the ring all-gather (n-1 steps, but O(n) messages per rank instead of O(n^2) in all).
constexpr int kOneShotCheckMax = 16;

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

void checkSameDevice(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  TORCH_CHECK(a.device() == b.device(), "bytescale ", what, ": tensors on different devices (",
              a.device(), " and ", b.device(), ")");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "bytescale ", what, ": dtype mismatch (",
              a.scalar_type(), " and ", b.scalar_type(), ")");
}

}  // namespace

void checkReduceOp(const c10d::ReduceOp& op, const at::Tensor& t, const std::string& what) {
  bool floating = at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type());
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(floating, "bytescale ", what, ": ReduceOp.AVG needs a floating dtype, got ",
                  t.scalar_type());
      return;
    case c10d::ReduceOp::PREMUL_SUM:
      TORCH_CHECK(floating, "bytescale ", what, ": PREMUL_SUM needs a floating dtype, got ",
                  t.scalar_type());
      TORCH_CHECK(op.supplement_, "bytescale ", what, ": PREMUL_SUM without a factor");
      return;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK(!floating, "bytescale ", what, ": bitwise reduce ops need an integral dtype, got ",
                  t.scalar_type());
      return;
    default:
      TORCH_CHECK(false, "bytescale ", what, ": unsupported reduce op ", static_cast<int>(op.op_));
  }
}

namespace {
void allGatherImpl(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
                   const std::string& what) {
  checkSameDevice(out, in, what);
  const int n = g.size(), i = g.myIndex();
  const int64_t m = in.numel();
  TORCH_CHECK(out.numel() == n * m, "bytescale ", what, ": output has ", out.numel(),
              " elements but the group of ", n, " needs ", n * m, " (", n, " x input ", in.sizes(),
              ")");
  at::Tensor o = contiguousOrSame(out);
  at::Tensor f = o.view(-1);
  f.narrow(0, i * m, m).copy_(in.reshape(-1));
  for (const auto& st : ringAllGatherSchedule(n, i))
    waitStep(tr, f.narrow(0, st.send_block * m, m), g.next(), f.narrow(0, st.recv_block * m, m),
             g.prev(), what);
  if (!o.is_same(out)) out.copy_(o);
}
}  // namespace

void allGather(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
               const std::string& what) {
  g.requireMember(what);
  checkConsistent(tr, g, OpCode::kAllGather, in, true, 0, what);
  allGatherImpl(tr, g, out, in, what);
}

void reduceScatter(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
                   const c10d::ReduceOp& op, const std::string& what) {
  g.requireMember(what);
  checkSameDevice(out, in, what);
  checkReduceOp(op, in, what);
  checkConsistent(tr, g, OpCode::kReduceScatter, out, true, op.op_, what);
  const int n = g.size(), i = g.myIndex();
  const int64_t m = out.numel();
  TORCH_CHECK(in.numel() == n * m, "bytescale ", what, ": input has ", in.numel(),
              " elements but the group of ", n, " needs ", n * m, " (", n, " x output ",
              out.sizes(), ")");
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
  g.requireMember(what);
  checkReduceOp(op, t, what);
  checkConsistent(tr, g, OpCode::kAllReduce, t, true, op.op_, what);
  const int n = g.size(), i = g.myIndex();
  const int64_t total = t.numel();
  at::Tensor w = contiguousOrSame(t);
  at::Tensor f = w.view(-1);
  if (n == 1 || total == 0) {
    premultiply(f, op);
    finish(f, op, n);
  } else if (total < n || total * t.element_size() <= kSmallAllReduceBytes) {
    at::Tensor gathered = at::empty({n, total}, f.options());
    allGatherImpl(tr, g, gathered, f, what);
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
  g.requireMember(what);
  const int n = g.size(), i = g.myIndex();
  TORCH_CHECK(root >= 0 && root < n, "bytescale ", what, ": root ", root,
              " is not a group rank of ", g.describe());
  checkConsistent(tr, g, OpCode::kBroadcast, t, true, root, what);
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
    tr.exchange(ops, what)->wait();
  } else if (rel == n - 1) {
    std::vector<P2POp> ops;
    for (int c = 0; c < chunks; ++c) ops.push_back({P2POp::kRecv, g.prev(), chunk(c)});
    tr.exchange(ops, what)->wait();
  } else {
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
              std::vector<int64_t> out_splits, std::vector<int64_t> in_splits,
              const std::string& what) {
  g.requireMember(what);
  checkSameDevice(out, in, what);
  const int n = g.size(), i = g.myIndex();
  TORCH_CHECK(in.dim() >= 1 && out.dim() >= 1, "bytescale ", what,
              ": all_to_all needs tensors with at least one dimension");
  auto fill = [&](std::vector<int64_t>& splits, const at::Tensor& t, const char* name) {
    if (splits.empty()) {
      TORCH_CHECK(t.size(0) % n == 0, "bytescale ", what, ": ", name, " dim 0 (", t.size(0),
                  ") is not divisible by the group size ", n, "; pass split sizes");
      splits.assign(n, t.size(0) / n);
    }
    TORCH_CHECK(static_cast<int>(splits.size()) == n, "bytescale ", what, ": ", name, " has ",
                splits.size(), " split sizes for a group of ", n);
    int64_t sum = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    TORCH_CHECK(sum == t.size(0), "bytescale ", what, ": ", name, " split sizes sum to ", sum,
                " but dim 0 is ", t.size(0));
  };
  checkConsistent(tr, g, OpCode::kAllToAll, in, false, 0, what);
  fill(in_splits, in, "input");
  fill(out_splits, out, "output");
  at::Tensor ic = contiguousOrSame(in);
  at::Tensor oc = contiguousOrSame(out);
  std::vector<int64_t> ioff(n + 1, 0), ooff(n + 1, 0);
  for (int j = 0; j < n; ++j) {
    ioff[j + 1] = ioff[j] + in_splits[j];
    ooff[j + 1] = ooff[j] + out_splits[j];
  }
  TORCH_CHECK(in_splits[i] == out_splits[i], "bytescale ", what, ": this rank sends ",
              in_splits[i], " rows to itself but expects ", out_splits[i]);
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
  g.requireMember(what);
  const int n = g.size(), i = g.myIndex();
  TORCH_CHECK(static_cast<int>(outputs.size()) == n && static_cast<int>(inputs.size()) == n,
              "bytescale ", what, ": needs ", n, " input and output tensors, got ", inputs.size(),
              " and ", outputs.size());
  checkConsistent(tr, g, OpCode::kAllToAll, inputs[0], false, 0, what);
  TORCH_CHECK(outputs[i].numel() == inputs[i].numel(), "bytescale ", what,
              ": the tensor this rank sends to itself has ", inputs[i].numel(),
              " elements but its output slot has ", outputs[i].numel());
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
  g.requireMember(what);
  const int n = g.size(), i = g.myIndex();
  TORCH_CHECK(root >= 0 && root < n, "bytescale ", what, ": root ", root, " outside the group");
  checkConsistent(tr, g, OpCode::kGather, in, true, root, what);
  if (i != root) {
    tr.exchange({{P2POp::kSend, g.globalRank(root), contiguousOrSame(in)}}, what)->wait();
    return;
  }
  TORCH_CHECK(static_cast<int>(outputs.size()) == n, "bytescale ", what, ": root needs ", n,
              " output tensors, got ", outputs.size());
  std::vector<at::Tensor> bufs(n);
  std::vector<P2POp> ops;
  for (int j = 0; j < n; ++j) {
    checkSameDevice(outputs[j], in, what);
    TORCH_CHECK(outputs[j].numel() == in.numel(), "bytescale ", what, ": output ", j, " has ",
                outputs[j].numel(), " elements, input has ", in.numel());
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
  g.requireMember(what);
  const int n = g.size(), i = g.myIndex();
  TORCH_CHECK(root >= 0 && root < n, "bytescale ", what, ": root ", root, " outside the group");
  checkConsistent(tr, g, OpCode::kScatter, out, true, root, what);
  if (i != root) {
    at::Tensor o = contiguousOrSame(out);
    tr.exchange({{P2POp::kRecv, g.globalRank(root), o}}, what)->wait();
    if (!o.is_same(out)) out.copy_(o);
    return;
  }
  TORCH_CHECK(static_cast<int>(inputs.size()) == n, "bytescale ", what, ": root needs ", n,
              " input tensors, got ", inputs.size());
  std::vector<P2POp> ops;
  for (int j = 0; j < n; ++j) {
    checkSameDevice(inputs[j], out, what);
    TORCH_CHECK(inputs[j].numel() == out.numel(), "bytescale ", what, ": input ", j, " has ",
                inputs[j].numel(), " elements, output has ", out.numel());
    if (j == i)
      out.copy_(inputs[j].view(out.sizes()));
    else
      ops.push_back({P2POp::kSend, g.globalRank(j), contiguousOrSame(inputs[j])});
  }
  tr.exchange(ops, what)->wait();
}

void reduce(Transport& tr, const RankMap& g, const at::Tensor& t, const c10d::ReduceOp& op,
            int root, const std::string& what) {
  g.requireMember(what);
  checkReduceOp(op, t, what);
  const int n = g.size(), i = g.myIndex();
  TORCH_CHECK(root >= 0 && root < n, "bytescale ", what, ": root ", root, " outside the group");
  checkConsistent(tr, g, OpCode::kReduce, t, true, root, what);
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

namespace {
std::atomic<bool>& checksFlag() {
  static std::atomic<bool> flag{[] {
    const char* v = std::getenv("BYTESCALE_CHECK_COLLECTIVES");
    return !(v && std::string(v) == "0");
  }()};
  return flag;
}
}  // namespace

bool checksEnabled() { return checksFlag().load(std::memory_order_relaxed); }
void setChecksEnabled(bool on) { checksFlag().store(on); }

at::Tensor fingerprint(OpCode op, const at::Tensor& t, bool shape_known, int64_t extra) {
  at::Tensor fp = at::zeros({kFingerprintLen}, at::TensorOptions().dtype(at::kLong));
  auto* p = fp.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(op);
  p[1] = t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1;
  if (shape_known && t.defined()) {
    p[2] = t.numel();
    p[3] = t.dim();
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the sizes
    for (auto d : t.sizes()) h = (h ^ static_cast<uint64_t>(d)) * 1099511628211ull;
    p[4] = static_cast<int64_t>(h & 0x7fffffffffffffffull);
  } else {
    p[2] = p[3] = p[4] = -1;
  }
  p[5] = extra;
  return fp;
}

namespace {
const char* opCodeName(int64_t c) {
  switch (static_cast<OpCode>(c)) {
    case OpCode::kAllReduce: return "all_reduce";
    case OpCode::kBroadcast: return "broadcast";
    case OpCode::kAllGather: return "all_gather";
    case OpCode::kReduceScatter: return "reduce_scatter";
    case OpCode::kAllToAll: return "all_to_all";
    case OpCode::kGather: return "gather";
    case OpCode::kScatter: return "scatter";
    case OpCode::kReduce: return "reduce";
    case OpCode::kBarrier: return "barrier";
  }
  return "unknown op";
}
std::string describeRow(const int64_t* r) {
  std::ostringstream os;
  os << opCodeName(r[0]);
  if (r[1] >= 0) os << " with dtype " << c10::toString(static_cast<at::ScalarType>(r[1]));
  if (r[2] >= 0) os << ", " << r[2] << " elements in " << r[3] << " dims";
  if (r[0] == static_cast<int64_t>(OpCode::kBroadcast) || r[0] == static_cast<int64_t>(OpCode::kReduce) ||
      r[0] == static_cast<int64_t>(OpCode::kGather) || r[0] == static_cast<int64_t>(OpCode::kScatter))
    os << ", root " << r[5];
  else if (r[5] != 0)
    os << ", reduce op " << r[5];
  return os.str();
}
}  // namespace

void verifyFingerprints(const at::Tensor& table, const RankMap& g, const std::string& what) {
  at::Tensor t = table.contiguous();
  const int n = g.size(), me = g.myIndex();
  const int64_t* rows = t.data_ptr<int64_t>();
  const int64_t* mine = rows + static_cast<int64_t>(me) * kFingerprintLen;
  for (int j = 0; j < n; ++j) {
    const int64_t* r = rows + static_cast<int64_t>(j) * kFingerprintLen;
    bool same = true;
    for (int k = 0; k < kFingerprintLen; ++k) same = same && r[k] == mine[k];
    if (!same) {
      // Report the mismatch relative to the group's first member so every rank says the same.
      const int64_t* r0 = rows;
      int bad = j;
      for (int q = 0; q < n; ++q) {
        bool eq = true;
        for (int k = 0; k < kFingerprintLen; ++k)
          eq = eq && rows[static_cast<int64_t>(q) * kFingerprintLen + k] == r0[k];
        if (!eq) {
          bad = q;
          break;
        }
      }
      TORCH_CHECK(false, "bytescale ", what, ": collective mismatch across ranks: rank ",
                  g.globalRank(bad), " called ", describeRow(rows + static_cast<int64_t>(bad) * kFingerprintLen),
                  " but rank ", g.globalRank(0), " called ", describeRow(r0));
    }
  }
}

void checkConsistent(Transport& tr, const RankMap& g, OpCode op, const at::Tensor& t,
                     bool shape_known, int64_t extra, const std::string& what) {
  if (!checksEnabled() || g.size() == 1 || tr.deviceType() != c10::DeviceType::CPU) return;
  at::Tensor fp = fingerprint(op, t, shape_known, extra);
  at::Tensor table = at::empty({g.size(), kFingerprintLen}, fp.options());
  if (g.size() <= kOneShotCheckMax) {
    // One round trip: every member sends its fingerprint to every other member at once.
    const int me = g.myIndex();
    table[me].copy_(fp);
    std::vector<P2POp> ops;
    for (int j = 0; j < g.size(); ++j) {
      if (j == me) continue;
      ops.push_back({P2POp::kSend, g.globalRank(j), fp});
      ops.push_back({P2POp::kRecv, g.globalRank(j), table[j]});
    }
    tr.exchange(ops, what + " (consistency check)")->wait();
  } else {
    allGatherImpl(tr, g, table, fp, what + " (consistency check)");
  }
  verifyFingerprints(table, g, what);
}

}  // namespace group_ops
}  // namespace comm
}  // namespace bytescale
