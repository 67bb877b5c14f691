// The checks every collective call goes through, written once (in the manner of c10d's Utils.hpp
// assert helpers): the world backend, dynamic groups and the CUDA plug-in all rely on them.
#include "comm/collective.h"

#include <ATen/ATen.h>

#include "comm/checks.h"

namespace bytescale {
namespace comm {

namespace {

// ---- assert helpers ---------------------------------------------------------------------------

// "N <items> for M <of>": list lengths that must agree.
void checkCount(size_t got, size_t want, const char* items, const char* of, size_t of_count,
                const std::string& what) {
  TORCH_CHECK(got == want, "bytescale ", what, ": ", got, " ", items, " for ", of_count, " ", of,
              " (needs ", want, ")");
}

void checkSameType(const at::Tensor& a, const at::Tensor& b, const char* a_name,
                   const char* b_name, const std::string& what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "bytescale ", what, ": ", a_name, " dtype ",
              a.scalar_type(), " differs from ", b_name, " dtype ", b.scalar_type());
}

// `t` must hold exactly `numel` elements (same dtype as `ref`).
void checkElements(const at::Tensor& t, int64_t numel, const at::Tensor& ref, const char* t_name,
                   const char* ref_name, const std::string& why, const std::string& what) {
  checkSameType(t, ref, t_name, ref_name, what);
  TORCH_CHECK(t.numel() == numel, "bytescale ", what, ": ", t_name, " has ", t.numel(),
              " elements but ", why, " needs ", numel, " (", ref_name, " ", ref.sizes(), ")");
}

void checkRoot(int root, const RankMap& g, const std::string& what) {
  TORCH_CHECK(root >= 0 && root < g.size(), "bytescale ", what, ": root ", root,
              " is not a group rank of ", g.describe(), " (group ranks are 0..", g.size() - 1, ")");
}

std::string group(int n) { return "the group of " + std::to_string(n); }

}  // namespace

size_t Collective::count() const {
  switch (kind) {
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce:
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllGatherInto:
      return inputs.size();
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kReduceScatterFrom:
      return outputs.size();
    case CollectiveKind::kBarrier:
      return 0;
    default:
      return 1;
  }
}

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

c10::DeviceType commonDevice(const std::vector<const std::vector<at::Tensor>*>& lists,
                             const std::string& what) {
  const at::Tensor* first = nullptr;
  for (const auto* l : lists) {
    for (const auto& t : *l) {
      TORCH_CHECK(t.defined(), "bytescale ", what, ": undefined tensor");
      TORCH_CHECK(!t.is_sparse(), "bytescale ", what, ": sparse tensors are not supported");
      if (!first) {
        first = &t;
        continue;
      }
      TORCH_CHECK(t.device() == first->device(), "bytescale ", what,
                  ": tensors on different devices (", first->device(), " and ", t.device(), ")");
    }
  }
  TORCH_CHECK(first, "bytescale ", what, ": no tensors given");
  return first->device().type();
}

void validate(Collective& c, const RankMap& g) {
  const std::string& what = c.what;
  const int n = g.size();
  const size_t k = c.count();
  if (c.hasReduceOp())
    for (const auto& t : c.kind == CollectiveKind::kReduceScatter ? c.outputs : c.inputs)
      checkReduceOp(c.op, t, what);
  if (c.hasRoot()) checkRoot(c.root, g, what);
  const bool is_root = c.hasRoot() && c.root == g.myIndex();
  switch (c.kind) {
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce:
      TORCH_CHECK(!c.inputs.empty(), "bytescale ", what, ": no tensors given");
      return;
    case CollectiveKind::kAllGather:
      checkCount(c.outputs.size(), k * n, "output tensors", "inputs in", k, what);
      for (size_t i = 0; i < c.outputs.size(); ++i)
        checkElements(c.outputs[i], c.inputs[i / n].numel(), c.inputs[i / n], "output tensor",
                      "input", "one rank's block", what);
      return;
    case CollectiveKind::kAllGatherInto:
      checkCount(c.outputs.size(), k, "outputs", "inputs", k, what);
      for (size_t i = 0; i < k; ++i)
        checkElements(c.outputs[i], n * c.inputs[i].numel(), c.inputs[i], "output", "input",
                      group(n) + " x input", what);
      return;
    case CollectiveKind::kGather:
      checkCount(c.inputs.size(), 1, "inputs", "ranks", 1, what);
      if (!is_root) return;
      checkCount(c.outputs.size(), n, "outputs on the root", "members in", n, what);
      for (const auto& o : c.outputs)
        checkElements(o, c.inputs[0].numel(), c.inputs[0], "output", "input", "one rank's block",
                      what);
      return;
    case CollectiveKind::kScatter:
      checkCount(c.outputs.size(), 1, "outputs", "ranks", 1, what);
      if (!is_root) return;
      checkCount(c.inputs.size(), n, "inputs on the root", "members in", n, what);
      for (const auto& in : c.inputs)
        checkElements(in, c.outputs[0].numel(), c.outputs[0], "input", "output",
                      "one rank's block", what);
      return;
    case CollectiveKind::kReduceScatter:
      checkCount(c.inputs.size(), k * n, "input tensors", "outputs in", k, what);
      for (size_t i = 0; i < c.inputs.size(); ++i)
        checkElements(c.inputs[i], c.outputs[i / n].numel(), c.outputs[i / n], "input tensor",
                      "output", "one rank's block", what);
      return;
    case CollectiveKind::kReduceScatterFrom:
      checkCount(c.inputs.size(), k, "inputs", "outputs", k, what);
      for (size_t i = 0; i < k; ++i)
        checkElements(c.inputs[i], n * c.outputs[i].numel(), c.outputs[i], "input", "output",
                      group(n) + " x output", what);
      return;
    case CollectiveKind::kAllToAll: {
      checkCount(c.inputs.size(), 1, "inputs", "ranks", 1, what);
      checkCount(c.outputs.size(), 1, "outputs", "ranks", 1, what);
      const at::Tensor& in = c.inputs[0];
      const at::Tensor& out = c.outputs[0];
      checkSameType(out, in, "output", "input", what);
      TORCH_CHECK(in.dim() >= 1 && out.dim() >= 1, "bytescale ", what,
                  ": all_to_all needs tensors with at least one dimension");
      const int64_t row_in = in.size(0) ? in.numel() / in.size(0) : in.numel();
      const int64_t row_out = out.size(0) ? out.numel() / out.size(0) : out.numel();
      TORCH_CHECK(in.size(0) == 0 || out.size(0) == 0 || row_in == row_out, "bytescale ", what,
                  ": input rows hold ", row_in, " elements but output rows ", row_out);
      c.in_splits = normalizeSplits(std::move(c.in_splits), in.size(0), n, what, "input");
      c.out_splits = normalizeSplits(std::move(c.out_splits), out.size(0), n, what, "output");
      const int me = g.myIndex();
      TORCH_CHECK(c.in_splits[me] == c.out_splits[me], "bytescale ", what, ": this rank sends ",
                  c.in_splits[me], " rows to itself but expects ", c.out_splits[me]);
      return;
    }
    case CollectiveKind::kAllToAllList: {
      checkCount(c.inputs.size(), n, "inputs", "members in", n, what);
      checkCount(c.outputs.size(), n, "outputs", "members in", n, what);
      for (int j = 0; j < n; ++j) checkSameType(c.outputs[j], c.inputs[j], "output", "input", what);
      const int me = g.myIndex();
      TORCH_CHECK(c.outputs[me].numel() == c.inputs[me].numel(), "bytescale ", what,
                  ": the tensor this rank sends to itself has ", c.inputs[me].numel(),
                  " elements but its output slot has ", c.outputs[me].numel());
      return;
    }
    case CollectiveKind::kBarrier:
      return;
  }
}

}  // namespace comm
}  // namespace bytescale
