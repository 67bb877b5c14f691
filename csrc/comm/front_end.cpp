#include "comm/front_end.h"

#include "common/handoff.h"

#include <algorithm>
#include <sstream>
#include <unordered_map>

#include "comm/special_ops.h"
#include "comm/traffic.h"

namespace bytescale {
namespace comm {

namespace {

std::string describeGroup(const RankMap& g, const std::string& kind) {
  constexpr int kShown = 16;
  if (g.size() <= kShown) return kind + " " + g.describe();
  std::ostringstream os;
  os << kind << " [";
  for (int i = 0; i < kShown - 1; ++i) os << g.ranks()[i] << ", ";
  os << "..., " << g.ranks().back() << "] (" << g.size() << " ranks)";
  return os.str();
}

// The bytes a collective's tensors hold (its payload, for the traffic counters).
int64_t payloadBytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts)
    if (t.defined() && !t.is_sparse()) n += static_cast<int64_t>(t.nbytes());
  return n;
}

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

// Every list of `lists` must hold n tensors (per-rank lists of all_gather / reduce_scatter).
void checkLists(const std::vector<std::vector<at::Tensor>>& lists, size_t want_lists, int n,
                const char* lists_name, const char* of, const std::string& what) {
  TORCH_CHECK(lists.size() == want_lists, "bytescale ", what, ": ", lists.size(), " ", lists_name,
              " for ", want_lists, " ", of);
  for (const auto& l : lists)
    TORCH_CHECK(static_cast<int>(l.size()) == n, "bytescale ", what, ": a list of ", lists_name,
                " has ", l.size(), " tensors, expected ", n);
}

Collective make(CollectiveKind kind, c10d::OpType type, const char* name) {
  Collective c;
  c.kind = kind;
  c.type = type;
  c.name = name;
  return c;
}

}  // namespace

// ---- P2PCoalescer ---------------------------------------------------------------------------

void P2PCoalescer::start(const std::string& what) {
  TORCH_CHECK(!active_, "bytescale ", what,
              ": startCoalescing called twice without endCoalescing");
  active_ = true;
  have_device_ = false;
  batch_ = Batch{};
}

c10::intrusive_ptr<CoalescedOpWork> P2PCoalescer::add(c10::DeviceType device, P2POp op, int rank,
                                                      WorkInfo info) {
  if (have_device_)
    TORCH_CHECK(device == batch_.device, "bytescale ", info.what,
                ": coalesced point-to-point ops on mixed devices (",
                c10::DeviceTypeName(batch_.device), " and ", c10::DeviceTypeName(device), ")");
  batch_.device = device;
  have_device_ = true;
  auto w = c10::make_intrusive<CoalescedOpWork>(rank, std::move(info),
                                                std::vector<at::Tensor>{op.tensor});
  batch_.ops.push_back(std::move(op));
  batch_.placeholders.push_back(w);
  return w;
}

P2PCoalescer::Batch P2PCoalescer::take(const std::string& what) {
  TORCH_CHECK(active_, "bytescale ", what, ": endCoalescing without startCoalescing");
  active_ = false;
  Batch b = std::move(batch_);
  batch_ = Batch{};
  return b;
}

// ---- CollectiveBackend ----------------------------------------------------------------------

namespace {

// From here on the op's tensors are Python-free shallow copies (common/handoff.h), the same copy
// for a tensor listed as input and output: the threads that may hold an op's last references
// (the CPU transport's worker and waiters, Gloo's, the NCCL watchdog), its Work and its future
// never free a Python-owned TensorImpl, so a process that exits without destroy_process_group
// while ops are in flight never aborts in the interpreter's finalization. A tensor that requires
// grad is passed as it is: autograd's checks must see it (an in-place AVG on a leaf parameter
// under grad mode raises, as Gloo's does), and its owner (a module) normally outlives the op.
void handOffTensors(Collective& c) {
  std::unordered_map<const c10::TensorImpl*, at::Tensor> made;
  auto copy = [&made](at::Tensor& t) {
    if (!t.defined() || t.requires_grad()) return;
    auto [it, fresh] = made.try_emplace(t.unsafeGetTensorImpl());
    if (fresh) it->second = handOff(t);
    t = it->second;
  };
  for (auto& t : c.inputs) copy(t);
  for (auto& t : c.outputs) copy(t);
}

}  // namespace

CollectiveBackend::CollectiveBackend(std::shared_ptr<const RankMap> group, const std::string& kind,
                                     std::chrono::milliseconds timeout)
    : c10d::Backend(group->myIndex(), group->size()),
      group_(std::move(group)),
      group_name_(describeGroup(*group_, kind)),
      timeout_(timeout) {}

WorkInfo CollectiveBackend::info(c10d::OpType type, std::string what,
                                 std::vector<int> peers) const {
  WorkInfo i;
  i.type = type;
  i.what = std::move(what);
  i.group = group_;
  i.peers = std::move(peers);
  i.timeout = timeout_;
  return i;
}

WorkInfo CollectiveBackend::info(const Collective& c) const {
  WorkInfo i = info(c.type, c.what);
  i.timeout = c.timeout;
  return i;
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::submit(Collective c,
                                                         std::chrono::milliseconds op_timeout) {
  c.what = opName(c.name);
  checkOpen(c.what);
  group_->requireMember(c.what);
  if (c.kind != CollectiveKind::kBarrier) c.device = commonDevice({&c.inputs, &c.outputs}, c.what);
  c.timeout = op_timeout > std::chrono::milliseconds(0) ? op_timeout : timeout_;
  validate(c, *group_);
  handOffTensors(c);
  seq_.fetch_add(1);
  countTraffic(TrafficScope::current(), payloadBytes(c.inputs), payloadBytes(c.outputs));
  auto work = execute(std::move(c));
  std::lock_guard<std::mutex> g(coalesce_mu_);
  if (coalescer_.active()) coalescer_.addCollective(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                            const c10d::BroadcastOptions& opts) {
  auto c = make(CollectiveKind::kBroadcast, c10d::OpType::BROADCAST, "broadcast");
  c.inputs = c.outputs = tensors;
  c.root = static_cast<int>(opts.rootRank);
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  for (const auto& t : tensors)
    if (t.defined() && t.is_sparse()) return allreduce_sparse(tensors, opts);
  auto c = make(CollectiveKind::kAllReduce, c10d::OpType::ALLREDUCE, "all_reduce");
  c.inputs = c.outputs = tensors;
  c.op = opts.reduceOp;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  auto c = make(CollectiveKind::kAllReduce, c10d::OpType::ALLREDUCE_COALESCED,
                "all_reduce_coalesced");
  c.inputs = c.outputs = tensors;
  c.op = opts.reduceOp;
  c.coalesced = true;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::reduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::ReduceOptions& opts) {
  auto c = make(CollectiveKind::kReduce, c10d::OpType::REDUCE, "reduce");
  c.inputs = c.outputs = tensors;
  c.op = opts.reduceOp;
  c.root = static_cast<int>(opts.rootRank);
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto c = make(CollectiveKind::kAllGather, c10d::OpType::ALLGATHER, "all_gather");
  checkLists(outputs, inputs.size(), getSize(), "output lists", "inputs", opName(c.name));
  c.inputs = inputs;
  c.outputs = flatten(outputs);
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto c = make(CollectiveKind::kAllGather, c10d::OpType::ALLGATHER_COALESCED,
                "all_gather_coalesced");
  // c10d's layout (Gloo's): outputs[j][k] receives group rank j's inputs[k].
  checkLists(outputs, getSize(), static_cast<int>(inputs.size()), "output lists", "ranks",
             opName(c.name));
  c.inputs = inputs;
  const size_t n = outputs.size();
  c.outputs.resize(inputs.size() * n);
  for (size_t j = 0; j < n; ++j)
    for (size_t k = 0; k < inputs.size(); ++k) c.outputs[k * n + j] = outputs[j][k];
  c.coalesced = true;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  auto c = make(CollectiveKind::kAllGatherInto, c10d::OpType::_ALLGATHER_BASE,
                "all_gather_into_tensor");
  c.inputs = {input};
  c.outputs = {output};
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto c = make(CollectiveKind::kAllGatherInto, c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED,
                "all_gather_into_tensor_coalesced");
  c.inputs = inputs;
  c.outputs = outputs;
  c.coalesced = true;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  auto c = make(CollectiveKind::kGather, c10d::OpType::GATHER, "gather");
  c.root = static_cast<int>(opts.rootRank);
  c.inputs = inputs;
  // torch passes [gather_list] on the root and [] elsewhere.
  if (c.root == group_->myIndex()) {
    TORCH_CHECK(outputs.size() == 1, "bytescale ", opName(c.name), ": the root needs one list of ",
                getSize(), " outputs, got ", outputs.size(), " lists");
    c.outputs = outputs[0];
  }
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  auto c = make(CollectiveKind::kScatter, c10d::OpType::SCATTER, "scatter");
  c.root = static_cast<int>(opts.rootRank);
  c.outputs = outputs;
  if (c.root == group_->myIndex()) {
    TORCH_CHECK(inputs.size() == 1, "bytescale ", opName(c.name), ": the root needs one list of ",
                getSize(), " inputs, got ", inputs.size(), " lists");
    c.inputs = inputs[0];
  }
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto c = make(CollectiveKind::kReduceScatter, c10d::OpType::REDUCE_SCATTER, "reduce_scatter");
  checkLists(inputs, outputs.size(), getSize(), "input lists", "outputs", opName(c.name));
  c.inputs = flatten(inputs);
  c.outputs = outputs;
  c.op = opts.reduceOp;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  auto c = make(CollectiveKind::kReduceScatterFrom, c10d::OpType::_REDUCE_SCATTER_BASE,
                "reduce_scatter_tensor");
  c.inputs = {input};
  c.outputs = {output};
  c.op = opts.reduceOp;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto c = make(CollectiveKind::kReduceScatterFrom, c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED,
                "reduce_scatter_tensor_coalesced");
  c.inputs = inputs;
  c.outputs = outputs;
  c.op = opts.reduceOp;
  c.coalesced = true;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  auto c = make(CollectiveKind::kAllToAll, c10d::OpType::ALLTOALL_BASE, "all_to_all_single");
  c.inputs = {input};
  c.outputs = {output};
  c.in_splits = input_splits;
  c.out_splits = output_splits;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllToAllOptions& opts) {
  auto c = make(CollectiveKind::kAllToAllList, c10d::OpType::ALLTOALL, "all_to_all");
  c.inputs = inputs;
  c.outputs = outputs;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::barrier(const c10d::BarrierOptions& opts) {
  auto c = make(CollectiveKind::kBarrier, c10d::OpType::BARRIER, "barrier");
  c.device = opts.device ? opts.device->type() : c10::DeviceType::CPU;
  return submit(std::move(c), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const std::string what = opName("all_reduce of sparse tensors");
  checkOpen(what);
  group_->requireMember(what);
  TORCH_CHECK(!tensors.empty(), "bytescale ", what, ": no tensors given");
  for (const auto& t : tensors) {
    TORCH_CHECK(t.defined() && t.layout() == c10::kSparse, "bytescale ", what,
                ": every tensor must be a sparse COO tensor (sparse and dense tensors mixed)");
    TORCH_CHECK(t.device().is_cpu(), "bytescale ", what, ": sparse tensors must be on the CPU, got ",
                t.device());
    TORCH_CHECK(t.sizes() == tensors[0].sizes() && t.scalar_type() == tensors[0].scalar_type(),
                "bytescale ", what, ": the tensors differ in sizes or dtype");
  }
  TORCH_CHECK(opts.reduceOp.op_ == c10d::ReduceOp::SUM, "bytescale ", what,
              ": only ReduceOp.SUM is supported for sparse tensors (as in Gloo)");
  seq_.fetch_add(1);
  auto tr = p2pTransport(c10::DeviceType::CPU, what);
  WorkInfo inf = info(c10d::OpType::ALLREDUCE, what);
  if (opts.timeout > std::chrono::milliseconds(0)) inf.timeout = opts.timeout;
  auto group = group_;
  std::vector<at::Tensor> ts = tensors;
  Transport* raw = tr.get();
  auto work = raw->run(std::move(inf), ts, [tr, group, ts, what] {
    special_ops::sparseAllReduce(*tr, *group, ts, what);
  });
  std::lock_guard<std::mutex> g(coalesce_mu_);
  if (coalescer_.active()) coalescer_.addCollective(work);
  return work;
}

void CollectiveBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const std::string what = opName("monitored_barrier");
  checkOpen(what);
  group_->requireMember(what);
  // c10d passes kUnsetTimeout (-1 ms) when the caller gave none; 0 is a valid (expired) timeout.
  const auto timeout = opts.timeout < std::chrono::milliseconds(0) ? timeout_ : opts.timeout;
  auto tr = p2pTransport(c10::DeviceType::CPU, what);
  special_ops::monitoredBarrier(*tr, *group_, timeout, wait_all_ranks, monitored_seq_.fetch_add(1),
                                what);
}

// ---- point-to-point -------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> CollectiveBackend::postP2P(c10::DeviceType device,
                                                          const std::vector<P2POp>& ops,
                                                          WorkInfo info) {
  auto tr = p2pTransport(device, info.what);
  tr->countPeers(ops);
  return tr->post(ops, std::move(info));
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::p2p(P2POp::Kind kind,
                                                      std::vector<at::Tensor>& tensors, int peer,
                                                      int tag) {
  const bool send = kind == P2POp::kSend;
  std::string what = opName(send ? "send" : "recv");
  checkOpen(what);
  group_->requireMember(what);
  TORCH_CHECK(tensors.size() == 1, "bytescale ", what, ": expects exactly one tensor, got ",
              tensors.size());
  auto device = commonDevice({&tensors}, what);
  TORCH_CHECK(tensors[0].is_contiguous(), "bytescale ", what, ": the tensor must be contiguous");
  TORCH_CHECK(peer >= 0 && peer < getSize() && peer != getRank(), "bytescale ", what, ": peer ",
              peer, " is not another member of the group (group ranks 0..", getSize() - 1,
              ", this rank is ", getRank(), ")");
  const int global = group_->globalRank(peer);
  what = std::string(send ? "send to" : "recv from") + " rank " + std::to_string(global) +
         " on " + group_name_;
  // see handOffTensors
  P2POp op{kind, global, tensors[0].requires_grad() ? tensors[0] : handOff(tensors[0]), p2pTag(tag)};
  auto inf = info(send ? c10d::OpType::SEND : c10d::OpType::RECV, what, {global});
  {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    if (coalescer_.active()) return coalescer_.add(device, std::move(op), getRank(), std::move(inf));
  }
  return postP2P(device, {op}, std::move(inf));
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::send(std::vector<at::Tensor>& tensors,
                                                       int dst_rank, int tag) {
  return p2p(P2POp::kSend, tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::recv(std::vector<at::Tensor>& tensors,
                                                       int src_rank, int tag) {
  return p2p(P2POp::kRecv, tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                int tag) {
  const std::string what = opName("recv from any source");
  checkOpen(what);
  group_->requireMember(what);
  TORCH_CHECK(tensors.size() == 1, "bytescale ", what, ": expects exactly one tensor, got ",
              tensors.size());
  auto device = commonDevice({&tensors}, what);
  TORCH_CHECK(device == c10::DeviceType::CPU, "bytescale ", what,
              ": needs a CPU tensor (NCCL has no receive from any source); name the source rank");
  TORCH_CHECK(tensors[0].is_contiguous(), "bytescale ", what, ": the tensor must be contiguous");
  {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    TORCH_CHECK(!coalescer_.active(), "bytescale ", what,
                ": not supported inside a coalescing block (batch_isend_irecv); name the source");
  }
  return postRecvAnysource(tensors[0], tag, info(c10d::OpType::RECVANYSOURCE, what));
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::postRecvAnysource(const at::Tensor&, int,
                                                                    WorkInfo info) {
  TORCH_CHECK(false, "bytescale ", info.what,
              ": supported on the world group only (dynamic groups match messages by a per-pair "
              "sequence); name the source rank, or receive on the world group");
}

void CollectiveBackend::startCoalescing() {
  std::lock_guard<std::mutex> g(coalesce_mu_);
  coalescer_.start(opName("coalescing"));
}

c10::intrusive_ptr<c10d::Work> CollectiveBackend::endCoalescing() {
  P2PCoalescer::Batch b;
  {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    b = coalescer_.take(opName("coalescing"));
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> parts = std::move(b.collectives);
  std::vector<int> peers;
  for (const auto& op : b.ops)
    if (std::find(peers.begin(), peers.end(), op.peer) == peers.end()) peers.push_back(op.peer);
  auto inf = info(c10d::OpType::COALESCED, opName("batch_isend_irecv"), peers);
  if (!b.ops.empty()) {
    c10::intrusive_ptr<c10d::Work> batch;
    try {
      batch = postP2P(b.device, b.ops, inf);
    } catch (...) {
      // The block's ops never launched: their Works fail with the same error.
      auto failed = c10::make_intrusive<Work>(getRank(), inf, std::vector<at::Tensor>{});
      failed->complete(std::current_exception());
      for (auto& p : b.placeholders) p->follow(failed);
      throw;
    }
    for (auto& p : b.placeholders) p->follow(batch);
    parts.push_back(batch);
  }
  if (parts.empty()) return completedWork(getRank(), inf, {});
  if (parts.size() == 1) return parts[0];
  return c10::make_intrusive<WorkList>(getRank(), inf, std::move(parts));
}

}  // namespace comm
}  // namespace bytescale
