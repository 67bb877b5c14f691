#include "comm/dynamic_group.h"

#include "comm/device_backends.h"
#include "comm/group_ops.h"

namespace bytescale {
namespace comm {

namespace {
// A group created without a timeout waits as long as the world group does.
std::chrono::milliseconds worldTimeout() {
  auto tr = worldTransport(c10::DeviceType::CPU);
  return tr ? tr->timeout() : std::chrono::milliseconds(0);
}
}  // namespace

DynamicGroupBackend::DynamicGroupBackend(std::vector<int> ranks, int world_size,
                                         int my_global_rank, std::chrono::milliseconds timeout)
    : CollectiveBackend(std::make_shared<const RankMap>(std::move(ranks), world_size,
                                                        my_global_rank),
                        "dynamic group", timeout > std::chrono::milliseconds(0) ? timeout : worldTimeout()) {}

std::shared_ptr<Transport> DynamicGroupBackend::p2pTransport(c10::DeviceType device,
                                                             const std::string& what) {
  return requireTransport(device, what);
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::execute(Collective c) {
  auto tr = requireTransport(c.device, c.what);
  auto inf = info(c);
  std::vector<at::Tensor> outputs = c.outputs;
  std::vector<at::Tensor> inputs = c.inputs;  // kept alive until done (CUDA: on the comm stream)
  auto group = rankMapPtr();
  Transport* raw = tr.get();
  return raw->run(std::move(inf), std::move(outputs),
                  [tr, group, c = std::move(c)] { group_ops::run(*tr, *group, c); },
                  std::move(inputs));
}

c10::intrusive_ptr<c10d::Work> DynamicGroupBackend::ringExchange(const at::Tensor& send,
                                                                 const at::Tensor& recv) {
  const std::string what = opName("ring_exchange");
  checkOpen(what);
  rankMap().requireMember(what);
  std::vector<at::Tensor> ts;
  if (send.defined()) ts.push_back(send);
  if (recv.defined()) ts.push_back(recv);
  auto inf = info(c10d::OpType::UNKNOWN, what, {rankMap().next(), rankMap().prev()});
  if (ts.empty() || rankMap().size() == 1) {
    if (rankMap().size() == 1 && send.defined() && recv.defined()) recv.copy_(send);
    return completedWork(getRank(), std::move(inf), ts);
  }
  auto device = commonDevice({&ts}, what);
  if (send.defined() && recv.defined())
    TORCH_CHECK(send.scalar_type() == recv.scalar_type(), "bytescale ", what, ": send dtype ",
                send.scalar_type(), " != recv dtype ", recv.scalar_type());
  auto tr = requireTransport(device, what);
  const auto ops = Transport::ringStepOps(send, rankMap().next(), recv, rankMap().prev());
  tr->countPeers(ops);
  return tr->post(ops, std::move(inf));
}

}  // namespace comm
}  // namespace bytescale
