#include "comm/consistency.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <sstream>

#include "comm/agreement.h"
#include "common/env.h"

namespace bytescale {
namespace comm {

namespace {

enum class OpCode : int64_t {
  kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kAllToAll, kGather, kScatter, kReduce,
  kBarrier
};

std::atomic<bool>& checksFlag() {
  static std::atomic<bool> flag{env::knobs().check_collectives};
  return flag;
}

OpCode opCode(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kBroadcast: return OpCode::kBroadcast;
    case CollectiveKind::kAllReduce: return OpCode::kAllReduce;
    case CollectiveKind::kReduce: return OpCode::kReduce;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllGatherInto: return OpCode::kAllGather;
    case CollectiveKind::kGather: return OpCode::kGather;
    case CollectiveKind::kScatter: return OpCode::kScatter;
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kReduceScatterFrom: return OpCode::kReduceScatter;
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kAllToAllList: return OpCode::kAllToAll;
    case CollectiveKind::kBarrier: return OpCode::kBarrier;
  }
  return OpCode::kBarrier;
}

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

bool rootOp(int64_t c) {
  auto op = static_cast<OpCode>(c);
  return op == OpCode::kBroadcast || op == OpCode::kReduce || op == OpCode::kGather ||
         op == OpCode::kScatter;
}

std::string describeRow(const int64_t* r) {
  std::ostringstream os;
  os << opCodeName(r[0]);
  if (r[1] >= 0) os << " with dtype " << c10::toString(static_cast<at::ScalarType>(r[1]));
  if (r[2] >= 0) os << ", " << r[2] << " elements in " << r[3] << (r[3] == 1 ? " tensor" : " tensors");
  if (rootOp(r[0]))
    os << ", root " << r[5];
  else if (r[5] != 0)
    os << ", reduce op " << r[5];
  return os.str();
}

// The tensors a kind's fingerprint covers, and whether their shapes must agree across ranks.
const std::vector<at::Tensor>& fingerprinted(const Collective& c, bool* shape_known) {
  *shape_known = c.kind != CollectiveKind::kAllToAll && c.kind != CollectiveKind::kAllToAllList;
  switch (c.kind) {
    case CollectiveKind::kScatter:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kReduceScatterFrom:
      return c.outputs;
    default:
      return c.inputs;
  }
}

}  // namespace

bool checksEnabled() { return checksFlag().load(std::memory_order_relaxed); }
void setChecksEnabled(bool on) { checksFlag().store(on); }

at::Tensor fingerprint(const Collective& c) {
  at::Tensor fp = at::empty({kFingerprintLen}, at::TensorOptions().dtype(at::kLong));
  auto* p = fp.data_ptr<int64_t>();
  bool shape_known = false;
  const auto& ts = fingerprinted(c, &shape_known);
  p[0] = static_cast<int64_t>(opCode(c.kind));
  p[1] = ts.empty() ? -1 : static_cast<int64_t>(ts[0].scalar_type());
  p[2] = p[3] = p[4] = -1;
  if (shape_known && !ts.empty()) {
    int64_t numel = 0;
    uint64_t h = kFnvOffset;
    for (const auto& t : ts) {
      numel += t.numel();
      h = fnv1a(h, static_cast<uint64_t>(t.scalar_type()));
      h = fnv1a(h, static_cast<uint64_t>(t.dim()));
      for (auto d : t.sizes()) h = fnv1a(h, static_cast<uint64_t>(d));
    }
    p[2] = numel;
    p[3] = static_cast<int64_t>(ts.size());
    p[4] = static_cast<int64_t>(h & 0x7fffffffffffffffull);
  }
  p[5] = c.hasRoot() ? c.root : (c.hasReduceOp() ? static_cast<int64_t>(c.op.op_) : 0);
  return fp;
}

void verifyFingerprints(const at::Tensor& table, const RankMap& g, const std::string& what) {
  at::Tensor t = table.contiguous();
  const int64_t* rows = t.data_ptr<int64_t>();
  // Reported relative to the group's first member, so every rank raises the same message.
  int bad = firstMismatchingRow(rows, g.size());
  if (bad < 0) return;
  TORCH_CHECK(false, "bytescale ", what, ": collective mismatch across ranks: rank ",
              g.globalRank(bad), " called ",
              describeRow(rows + static_cast<int64_t>(bad) * kFingerprintLen), " but rank ",
              g.globalRank(0), " called ", describeRow(rows));
}

void checkConsistent(Transport& tr, const RankMap& g, const Collective& c) {
  if (!checksEnabled() || g.size() == 1) return;
  at::Tensor fp = fingerprint(c);
  const int64_t* p = fp.data_ptr<int64_t>();
  const std::vector<int64_t> payload(p, p + kFingerprintLen);
  const std::string what = c.what + " (consistency check)";
  // CPU: in the transport's order (the worker runs this inside the collective's body). Other
  // devices (and the staged transport on any device): a host exchange, never through the
  // device's communication stream, over the channel of the transport's own rank space (a static
  // group's ranks 0..k-1 are not world ranks).
  auto channel = tr.agreementChannel();
  TORCH_CHECK(channel || tr.deviceType() == c10::DeviceType::CPU, "bytescale ", what,
              ": no host channel for the check (call dist.init_process_group(\"bytescale\") "
              "first)");
  auto rows = agree(channel ? *channel : tr, g, AgreementKind::kCollective, payload, what);
  at::Tensor table = at::empty({g.size(), kFingerprintLen}, fp.options());
  for (int j = 0; j < g.size(); ++j)
    std::copy(rows[j].begin(), rows[j].begin() + kFingerprintLen,
              table.data_ptr<int64_t>() + static_cast<int64_t>(j) * kFingerprintLen);
  verifyFingerprints(table, g, c.what);
}

}  // namespace comm
}  // namespace bytescale
