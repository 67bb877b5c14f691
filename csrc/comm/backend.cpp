#include "comm/backend.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <algorithm>

#include "comm/consistency.h"
#include "comm/group_ops.h"
#include "comm/work.h"
#include "common/handoff.h"

namespace bytescale {
namespace comm {

namespace {

std::vector<int> iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

bool premul(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::AVG || op.op_ == c10d::ReduceOp::PREMUL_SUM;
}

// True when a CPU collective runs as bytescale's P2P algorithm instead of Gloo's: Gloo lacks the
// reduction, the op, or (for lists of several tensors) reads the list as copies of ONE tensor.
bool viaGroupOps(const Collective& c) {
  switch (c.kind) {
    case CollectiveKind::kAllReduce:
      return premul(c.op);
    case CollectiveKind::kReduce:
      return premul(c.op) || c.count() > 1;
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllGatherInto:
      return c.count() > 1;
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kReduceScatterFrom:
    case CollectiveKind::kAllToAllList:
      return true;
    default:
      return false;
  }
}

// The Gloo call of a collective that viaGroupOps() leaves to Gloo.
c10::intrusive_ptr<c10d::Work> launchGloo(c10d::Backend& gloo, const Collective& c) {
  std::vector<at::Tensor> in = handOff(c.inputs), out = handOff(c.outputs);
  switch (c.kind) {
    case CollectiveKind::kBroadcast: {
      c10d::BroadcastOptions o;
      o.rootRank = c.root;
      return gloo.broadcast(in, o);
    }
    case CollectiveKind::kAllReduce: {
      if (c.count() == 1) {
        c10d::AllreduceOptions o;
        o.reduceOp = c.op;
        return gloo.allreduce(in, o);
      }
      c10d::AllreduceCoalescedOptions o;
      o.reduceOp = c.op;
      return gloo.allreduce_coalesced(in, o);
    }
    case CollectiveKind::kReduce: {
      c10d::ReduceOptions o;
      o.reduceOp = c.op;
      o.rootRank = c.root;
      return gloo.reduce(in, o);
    }
    case CollectiveKind::kAllGather: {
      std::vector<std::vector<at::Tensor>> outs{out};
      return gloo.allgather(outs, in, c10d::AllgatherOptions());
    }
    case CollectiveKind::kAllGatherInto:
      return gloo._allgather_base(out[0], in[0], c10d::AllgatherOptions());
    case CollectiveKind::kGather: {
      c10d::GatherOptions o;
      o.rootRank = c.root;
      std::vector<std::vector<at::Tensor>> outs;
      if (!out.empty()) outs.push_back(out);
      return gloo.gather(outs, in, o);
    }
    case CollectiveKind::kScatter: {
      c10d::ScatterOptions o;
      o.rootRank = c.root;
      std::vector<std::vector<at::Tensor>> ins;
      if (!in.empty()) ins.push_back(in);
      return gloo.scatter(out, ins, o);
    }
    case CollectiveKind::kAllToAll: {
      std::vector<int64_t> os = c.out_splits, is = c.in_splits;
      return gloo.alltoall_base(out[0], in[0], os, is, c10d::AllToAllOptions());
    }
    case CollectiveKind::kBarrier:
      return gloo.barrier(c10d::BarrierOptions());
    default:
      TORCH_CHECK(false, "bytescale ", c.what, ": not a Gloo collective");
  }
}

}  // namespace

BytescaleBackend::BytescaleBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                   std::chrono::milliseconds timeout,
                                   c10::intrusive_ptr<c10d::Backend> gloo)
    : BytescaleBackend(std::move(store), rank, size, timeout, std::move(gloo), iota(size), true) {
  registerWorldTransport(c10::DeviceType::CPU, cpu_);
  // The CUDA plug-in is created now (its communicator still lazily, by the first world collective
  // on a CUDA tensor or by device_id=), so dynamic groups and ring attention find its transport
  // and can say precisely what is missing.
  if (hasDeviceBackend(c10::DeviceType::CUDA) && at::hasCUDA()) {
    auto plugin = makeDeviceBackend(c10::DeviceType::CUDA, {store_, rank, size, timeout, cpu_});
    registerWorldTransport(c10::DeviceType::CUDA, plugin.transport);
    plugins_[c10::DeviceType::CUDA] = std::move(plugin);
  }
}

BytescaleBackend::BytescaleBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                   std::chrono::milliseconds timeout,
                                   c10::intrusive_ptr<c10d::Backend> gloo,
                                   std::vector<int> global_ranks, bool world)
    : CollectiveBackend(std::make_shared<const RankMap>(iota(size), size, rank),
                        world ? std::string("world group")
                              : "static group of global ranks " +
                                    RankMap(global_ranks, *std::max_element(global_ranks.begin(),
                                                                            global_ranks.end()) + 1,
                                            -1)
                                        .describe() +
                                    ", group ranks",
                        timeout),
      store_(std::move(store)),
      gloo_(std::move(gloo)),
      world_(world),
      global_ranks_(std::move(global_ranks)) {
  TORCH_CHECK(gloo_, "bytescale: the ", world ? "world" : "static group's",
              " backend needs a Gloo backend for CPU tensors");
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == size, "bytescale: a group of ", size,
              " ranks was given ", global_ranks_.size(), " global ranks");
  cpu_ = std::make_shared<GlooTransport>(gloo_, rank, size, timeout);
}

c10::intrusive_ptr<BytescaleBackend> BytescaleBackend::makeStatic(
    c10::intrusive_ptr<c10d::Store> store, int rank, std::chrono::milliseconds timeout,
    c10::intrusive_ptr<c10d::Backend> gloo, std::vector<int> global_ranks,
    BytescaleBackend* parent) {
  const int size = static_cast<int>(global_ranks.size());
  TORCH_CHECK(rank >= 0 && rank < size, "bytescale: static group rank ", rank, " outside [0, ",
              size, ")");
  // A private constructor: c10::make_intrusive cannot reach it.
  auto g = c10::intrusive_ptr<BytescaleBackend>::unsafe_steal_from_new(
      new BytescaleBackend(store, rank, size, timeout, std::move(gloo), global_ranks, false));
  if (parent != nullptr && parent->plugins_.count(c10::DeviceType::CUDA)) {
    std::vector<int> in_parent;  // the members as group ranks of the parent
    for (int r : global_ranks) {
      auto it = std::find(parent->global_ranks_.begin(), parent->global_ranks_.end(), r);
      TORCH_CHECK(it != parent->global_ranks_.end(), "bytescale: global rank ", r,
                  " of the new group is not in the parent group");
      in_parent.push_back(static_cast<int>(it - parent->global_ranks_.begin()));
    }
    auto cuda = parent->splitCuda(store, rank, in_parent, timeout, g->cpu_);
    if (cuda.backend) g->plugins_[c10::DeviceType::CUDA] = std::move(cuda);
  } else if (parent == nullptr && hasDeviceBackend(c10::DeviceType::CUDA) && at::hasCUDA()) {
    g->plugins_[c10::DeviceType::CUDA] =
        makeDeviceBackend(c10::DeviceType::CUDA, {g->store_, rank, size, timeout, g->cpu_});
  }
  return g;
}

DeviceBackend BytescaleBackend::splitCuda(const c10::intrusive_ptr<c10d::Store>& store,
                                          int group_rank, const std::vector<int>& members,
                                          std::chrono::milliseconds timeout,
                                          std::shared_ptr<Transport> cpu) {
  auto it = plugins_.find(c10::DeviceType::CUDA);
  if (it == plugins_.end()) return {};
  const int size = static_cast<int>(members.size());
  if (!it->second.split) {  // a plug-in that cannot split: the group's own, created lazily
    if (group_rank < 0) return {};
    return makeDeviceBackend(c10::DeviceType::CUDA, {store, group_rank, size, timeout, cpu});
  }
  // Distinct groups of one split are disjoint: their first member (as a parent rank) tells them
  // apart, and every member computes the same color.
  const int color = group_rank < 0 ? -1 : *std::min_element(members.begin(), members.end());
  return it->second.split({store, group_rank, size, timeout, cpu}, color, std::max(group_rank, 0));
}

void BytescaleBackend::performNoColorSplit(at::Device device) {
  TORCH_CHECK(device.type() == c10::DeviceType::CUDA, "bytescale: perform_nocolor_split on ",
              device, ": only CUDA communicators are split");
  splitCuda(store_, -1, {}, timeout());
}

c10::intrusive_ptr<c10d::Backend::Options> BytescaleBackend::getBackendOptions() {
  return c10::make_intrusive<Options>("bytescale", timeout());
}

c10::intrusive_ptr<c10d::Backend> BytescaleBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  std::lock_guard<std::mutex> g(split_mu_);
  const std::string name = opts ? opts->group_name : std::string();
  if (!name.empty() && name == last_split_name_) return last_split_;
  const auto timeout = opts && opts->timeout > std::chrono::milliseconds(0) ? opts->timeout
                                                                          : this->timeout();
  auto me = std::find(ranks.begin(), ranks.end(), getRank());
  c10::intrusive_ptr<c10d::Backend> out;
  if (me == ranks.end()) {
    splitCuda(store, -1, ranks, timeout);  // NCCL: every rank of the parent takes part
  } else {
    const int group_rank = static_cast<int>(me - ranks.begin());
    std::vector<int> global;
    for (int r : ranks) global.push_back(global_ranks_.at(r));
    auto gopts = gloo_->getBackendOptions()->clone();
    gopts->timeout = timeout;
    gopts->group_name = name;
    auto gloo = gloo_->split(store, ranks, gopts);
    TORCH_CHECK(gloo, "bytescale: splitting the Gloo context failed for group ", name);
    auto child = c10::intrusive_ptr<BytescaleBackend>::unsafe_steal_from_new(
        new BytescaleBackend(store, group_rank, static_cast<int>(ranks.size()), timeout,
                             std::move(gloo), global, false));
    auto cuda = splitCuda(store, group_rank, ranks, timeout, child->cpu_);
    if (cuda.backend) child->plugins_[c10::DeviceType::CUDA] = std::move(cuda);
    out = child;
  }
  last_split_name_ = name;
  last_split_ = out;
  return out;
}

BytescaleBackend::~BytescaleBackend() {
  try {
    shutdown();
  } catch (...) {
  }
}

void BytescaleBackend::shutdown() {
  if (shut_down_.exchange(true)) return;
  if (world_) {
    unregisterWorldTransport(c10::DeviceType::CPU, cpu_.get());
    for (auto& [type, p] : plugins_) unregisterWorldTransport(type, p.transport.get());
  }
  {
    std::lock_guard<std::mutex> g(split_mu_);
    last_split_.reset();
  }
  cpu_->shutdown();
  for (auto& [type, p] : plugins_) p.backend->shutdown();
}

void BytescaleBackend::abort() {
  for (auto& [type, p] : plugins_) p.backend->abort();
  shutdown();
}

void BytescaleBackend::checkOpen(const std::string& what) const {
  TORCH_CHECK_WITH(DistBackendError, !shut_down_.load(), "bytescale ", what,
                   ": the backend has been shut down");
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::postRecvAnysource(const at::Tensor& tensor,
                                                                   int tag, WorkInfo info) {
  return cpu_->postRecvAnysource(tensor, tag, std::move(info));
}

std::shared_ptr<Transport> BytescaleBackend::transport(c10::DeviceType device) const {
  if (device == c10::DeviceType::CPU) return cpu_;
  auto it = plugins_.find(device);
  return it == plugins_.end() ? nullptr : it->second.transport;
}

bool BytescaleBackend::deviceConnected(c10::DeviceType device) const {
  auto it = plugins_.find(device);
  if (it == plugins_.end()) return false;
  return !it->second.connected || it->second.connected();
}

const DeviceBackend& BytescaleBackend::plugin(c10::DeviceType device,
                                              const std::string& what) const {
  auto it = plugins_.find(device);
  TORCH_CHECK(device == c10::DeviceType::CUDA || it != plugins_.end(), "bytescale ", what,
              ": unsupported device type ", c10::DeviceTypeName(device),
              " (bytescale handles cpu and cuda tensors)");
  TORCH_CHECK(it != plugins_.end(), "bytescale ", what, ": CUDA tensors need ",
              hasDeviceBackend(device) ? "a GPU visible when the process group was created"
                                       : "bytescale built with CUDA (this build is CPU-only)");
  return it->second;
}

std::shared_ptr<Transport> BytescaleBackend::p2pTransport(c10::DeviceType device,
                                                          const std::string& what) {
  if (device == c10::DeviceType::CPU) return cpu_;
  return plugin(device, what).transport;
}

void BytescaleBackend::eagerConnectSingleDevice(at::Device device) {
  if (device.type() == c10::DeviceType::CPU) return;
  plugin(device.type(), "eager connect").backend->eagerConnectSingleDevice(device);
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::execute(Collective c) {
  if (c.device != c10::DeviceType::CPU) return plugin(c.device, c.what).backend->execute(std::move(c));
  return executeOnCpu(std::move(c));
}

c10::intrusive_ptr<c10d::Work> BytescaleBackend::executeOnCpu(Collective c) {
  auto inf = info(c);
  std::vector<at::Tensor> outputs = c.outputs;
  auto cpu = cpu_;
  auto world = rankMapPtr();
  if (viaGroupOps(c))
    return cpu->run(std::move(inf), std::move(outputs),
                    [cpu, world, c = std::move(c)] { group_ops::run(*cpu, *world, c); });
  const bool checked = checksEnabled() && getSize() > 1;
  if (!checked && !cpu->inOrder())  // unchecked: Gloo's own Work, wrapped
    return adoptWork(launchGloo(*gloo_, c), getRank(), std::move(inf), std::move(outputs));
  // Checked: the fingerprint exchange is blocking, so the check AND the Gloo collective run on the
  // CPU transport's worker: the caller never blocks (a collective issued from an autograd hook
  // while a peer is still in ring attention must not stall this rank's own ring traffic), and
  // all checked collectives (and barriers) keep one order per rank. The check's messages use the
  // worker's own tag channel (gloo_transport.h), apart from ring attention's traffic. In
  // NCCL-order mode every world collective runs there, in issue order with the exchanges.
  auto gloo = gloo_;
  return cpu->run(std::move(inf), std::move(outputs), [gloo, cpu, world, checked, c = std::move(c)] {
    if (checked && c.kind != CollectiveKind::kBarrier) {
      cpu->noteNativeWait("the consistency check");
      checkConsistent(*cpu, *world, c);
    }
    cpu->noteNativeWait(std::string("Gloo's ") + c.name);
    launchGloo(*gloo, c)->wait();
  });
}

}  // namespace comm
}  // namespace bytescale
