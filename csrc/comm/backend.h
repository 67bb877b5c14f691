// The "bytescale" torch.distributed backend for the world group: the executor behind the front end
// (front_end.h) for the world.
//
//   CPU tensors:  Gloo (a torch ProcessGroupGloo handed in from Python) for the collectives it does
//                 natively; bytescale's P2P algorithms (group_ops) over the GlooTransport for what
//                 Gloo lacks (AVG / PREMUL_SUM reductions, reduce-scatter, list all-to-all, ...).
//   CUDA tensors: the device plug-in registered for CUDA (device_backends.h; the NCCL backend of
//                 csrc/cuda/comm/ when built with CUDA), one communicator for the whole world.
//
// The world backend registers its transports as the process's world transports, so dynamic groups
// and ring attention run on the same communicators.
//
// The same class serves STATIC groups: subgroups created collectively (dist.new_group,
// dist.split_group, DeviceMesh) that get communicators of their own: a Gloo context of the members
// (CPU; natives and the P2P algorithms run on it, never on the world's channel) and, on CUDA, an
// NCCL communicator split from the parent's with ncclCommSplit (every rank of the parent takes
// part: members with a color, the others with no color), or, when the parent's communicator is
// not connected yet, one created on the group's first CUDA collective. Static groups do not
// register world transports.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/device_backends.h"
#include "comm/front_end.h"
#include "comm/gloo_transport.h"

namespace bytescale {
namespace comm {

class BytescaleBackend final : public CollectiveBackend {
 public:
  // The world group.
  BytescaleBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> gloo);
  // A static group of `global_ranks` (this process at `rank`) on `gloo`, a Gloo context of the
  // members. `parent` (optional): the backend whose CUDA communicator the group's is split from
  // (every rank of the parent group must take part: the members here, the others through
  // performNoColorSplit); without it the group's CUDA communicator is created on its first
  // CUDA collective.
  static c10::intrusive_ptr<BytescaleBackend> makeStatic(
      c10::intrusive_ptr<c10d::Store> store, int rank, std::chrono::milliseconds timeout,
      c10::intrusive_ptr<c10d::Backend> gloo, std::vector<int> global_ranks,
      BytescaleBackend* parent);
  ~BytescaleBackend() override;

  // Splitting (dist.split_group, DeviceMesh on a device-bound world): a static group of the
  // members `ranks` (group ranks of this backend); nullptr for a non-member, which still takes
  // part in the CUDA communicator split. torch calls it once per device type with the same group
  // name: the second call returns the first one's group.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  c10::intrusive_ptr<Options> getBackendOptions() override;
  // A non-member's part in a split of this backend's CUDA communicator (torch calls it on the
  // non-members of a dist.new_group when the world is bound to a device).
  void performNoColorSplit(at::Device device);
  bool isWorld() const { return world_; }
  // Global ranks of the members, in group-rank order.
  const std::vector<int>& globalRanks() const { return global_ranks_; }

  const std::string getBackendName() const override { return "bytescale"; }

  c10::intrusive_ptr<c10d::Work> execute(Collective c) override;
  std::shared_ptr<Transport> p2pTransport(c10::DeviceType device,
                                          const std::string& what) override;

  void eagerConnectSingleDevice(at::Device device) override;
  void shutdown() override;
  void abort() override;

  std::shared_ptr<Transport> transport(c10::DeviceType device) const;
  // Whether the device plug-in's world communicator exists (false without a plug-in).
  bool deviceConnected(c10::DeviceType device) const;

 protected:
  void checkOpen(const std::string& what) const override;
  c10::intrusive_ptr<c10d::Work> postRecvAnysource(const at::Tensor& tensor, int tag,
                                                   WorkInfo info) override;

 private:
  // The plug-in of a non-CPU device type (raises naming what is missing).
  BytescaleBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> gloo,
                   std::vector<int> global_ranks, bool world);
  const DeviceBackend& plugin(c10::DeviceType device, const std::string& what) const;
  // The CUDA plug-in of a static group of `global_ranks` split from this backend's (member), or
  // this rank's no-color part of the split (non-member: color < 0; returns an empty plug-in).
  // `cpu`: the new group's CPU transport (a member's; the staged transport runs over it).
  DeviceBackend splitCuda(const c10::intrusive_ptr<c10d::Store>& store, int group_rank,
                          const std::vector<int>& global_ranks, std::chrono::milliseconds timeout,
                          std::shared_ptr<Transport> cpu = nullptr);
  c10::intrusive_ptr<c10d::Work> executeOnCpu(Collective c);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::shared_ptr<GlooTransport> cpu_;
  std::map<c10::DeviceType, DeviceBackend> plugins_;  // fixed after construction
  std::atomic<bool> shut_down_{false};
  bool world_ = true;
  std::vector<int> global_ranks_;
  std::mutex split_mu_;
  std::string last_split_name_;  // split() is called once per device type for one group
  c10::intrusive_ptr<c10d::Backend> last_split_;
};

}  // namespace comm
}  // namespace bytescale
