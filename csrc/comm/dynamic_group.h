// A dynamic group: any ordered set of global ranks, created locally with no communication and no
// new communicator. The front end (front_end.h) checks its calls; its executor runs them as P2P
// algorithms (group_ops) on the world backend's transports, so any number of disjoint groups can
// be active at once.
#pragma once

#include "comm/front_end.h"

namespace bytescale {
namespace comm {

class DynamicGroupBackend final : public CollectiveBackend {
 public:
  // ranks: ordered global ranks; my_global_rank may be a non-member (every op then raises).
  // timeout <= 0: the world group's timeout.
  DynamicGroupBackend(std::vector<int> ranks, int world_size, int my_global_rank,
                      std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  const std::string getBackendName() const override { return "bytescale"; }
  std::string describe() const { return groupName(); }

  c10::intrusive_ptr<c10d::Work> execute(Collective c) override;
  std::shared_ptr<Transport> p2pTransport(c10::DeviceType device,
                                          const std::string& what) override;

  // Ring exchange for ring attention: send `send` to the next member and receive `recv` from the
  // previous member, as one batched step. Either tensor may be undefined.
  c10::intrusive_ptr<c10d::Work> ringExchange(const at::Tensor& send, const at::Tensor& recv);

 protected:
  int p2pTag(int) const override { return -1; }
};

}  // namespace comm
}  // namespace bytescale
