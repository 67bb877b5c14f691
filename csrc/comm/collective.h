// One collective call in normal form: what the front end (front_end.h) makes of each of c10d's
// entry points before any executor sees it. Executors (Gloo natives, the P2P algorithms of
// group_ops, NCCL) implement these twelve kinds and nothing else; validate() has checked the call
// against the group (counts, sizes, dtypes, roots, split sizes, reduce op) on this rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "comm/schedule.h"

namespace bytescale {
namespace comm {

// Layout of inputs / outputs per kind (n = group size, K = number of independent tensors):
//   kBroadcast, kAllReduce, kReduce: inputs == outputs, K tensors, each its own operation, in place.
//   kAllGather:         inputs[k]; outputs[k * n + j] receives group rank j's inputs[k].
//   kAllGatherInto:     inputs[k]; outputs[k] holds n * inputs[k].numel() elements, rank-major.
//   kGather:            inputs[0]; outputs[j] from group rank j on the root, empty elsewhere.
//   kScatter:           outputs[0]; inputs[j] for group rank j on the root, empty elsewhere.
//   kReduceScatter:     outputs[k]; inputs[k * n + j] is this rank's contribution to rank j.
//   kReduceScatterFrom: outputs[k]; inputs[k] holds n * outputs[k].numel() elements, rank-major.
//   kAllToAll:          inputs[0], outputs[0] split along dim 0 by in_splits / out_splits (n each).
//   kAllToAllList:      inputs[j] goes to group rank j; outputs[j] comes from group rank j.
//   kBarrier:           no tensors.
enum class CollectiveKind : int {
  kBroadcast,
  kAllReduce,
  kReduce,
  kAllGather,
  kAllGatherInto,
  kGather,
  kScatter,
  kReduceScatter,
  kReduceScatterFrom,
  kAllToAll,
  kAllToAllList,
  kBarrier,
};

struct Collective {
  CollectiveKind kind = CollectiveKind::kBarrier;
  c10d::OpType type = c10d::OpType::UNKNOWN;
  const char* name = "";  // torch's name of the call: "all_reduce", "reduce_scatter_tensor", ...
  std::string what;       // name and group, for errors: "all_reduce on dynamic group [0, 2]"
  c10::DeviceType device = c10::DeviceType::CPU;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> outputs;
  c10d::ReduceOp op;      // kAllReduce, kReduce, kReduceScatter*
  int root = 0;           // group rank: kBroadcast, kReduce, kGather, kScatter
  std::vector<int64_t> in_splits, out_splits;  // kAllToAll: n rows counts each (never empty)
  bool coalesced = false;  // came from a *_coalesced entry point
  std::chrono::milliseconds timeout{0};        // the group's timeout

  // Number of independent operations (K above).
  size_t count() const;
  bool hasReduceOp() const {
    return kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduce ||
           kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kReduceScatterFrom;
  }
  bool hasRoot() const {
    return kind == CollectiveKind::kBroadcast || kind == CollectiveKind::kReduce ||
           kind == CollectiveKind::kGather || kind == CollectiveKind::kScatter;
  }
};

// Checks `c` (built by the front end) against the group on this rank; throws naming what is wrong.
// Also fills all-to-all split sizes left empty (equal splits). `g` is the group, me a member.
void validate(Collective& c, const RankMap& g);

// Reduction ops the backends support: SUM, AVG (floating types), PRODUCT, MIN, MAX,
// BAND/BOR/BXOR (integral and bool), PREMUL_SUM (floating, with a factor).
void checkReduceOp(const c10d::ReduceOp& op, const at::Tensor& t, const std::string& what);

// The tensors' common device type; every tensor must be defined and dense, all on one device.
c10::DeviceType commonDevice(const std::vector<const std::vector<at::Tensor>*>& lists,
                             const std::string& what);

}  // namespace comm
}  // namespace bytescale
