// The transport interface: how every distributed algorithm in bytescale moves bytes.
//
// There is one transport per device type per world backend: GlooTransport (CPU tensors, delegating
// to a torch ProcessGroupGloo) and the NCCL transport of the CUDA plug-in (csrc/cuda/comm/, one
// NCCL communicator for the whole world), registered through comm/device_backends.h. Dynamic
// groups, ring attention and planner-driven data movement are written once against this
// interface, so the multi-process CPU tests exercise the very code that runs over NCCL.
//
// Ordering contract (the same on both transports):
//   * Point-to-point messages between a pair of ranks, in one direction, are matched in the order
//     they are issued. Every pair of ranks must therefore issue their mutual sends/recvs in the same
//     relative order. The planner guarantees this by giving every ring micro-batch the same relative
//     order on all members of its group.
//   * Messages to different peers progress independently: disjoint dynamic groups never interfere.
//   * Full-world collectives (native()) need every rank, in the same order on every rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/schedule.h"
#include "comm/traffic.h"

namespace bytescale {
namespace comm {

// One point-to-point operation against a GLOBAL rank.
struct P2POp {
  enum Kind { kSend, kRecv };
  Kind kind;
  int peer;          // global rank of the other side
  at::Tensor tensor; // contiguous; for kRecv the destination (filled in place)
  int tag = -1;      // user tag (Gloo only; NCCL has none); -1: bytescale's own sequence tags
};

// What an asynchronous operation is, for its Work and for every error it raises.
struct WorkInfo {
  c10d::OpType type = c10d::OpType::UNKNOWN;
  std::string what;                      // op and group: "recv on dynamic group [0, 2]"
  std::shared_ptr<const RankMap> group;  // the group it runs in (may be null)
  std::vector<int> peers;                // P2P: the global ranks it talks to; else every member
  std::chrono::milliseconds timeout{0};  // the group's timeout (Work::wait's default); 0: none
};

// A launched batch of P2P operations, for algorithms that wait step by step.
//   CPU:  the ops are posted to Gloo and progress in Gloo's threads; wait() blocks the calling
//         thread until all completed (throws on error or timeout, naming the peers).
//   CUDA: the ops are enqueued between ncclGroupStart/End on the transport's communication stream,
//         after that stream waited for the caller's current stream; wait() makes the caller's
//         *current* stream wait on the completion event (no CPU block).
class PendingExchange {
 public:
  virtual ~PendingExchange() = default;
  virtual void wait() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual c10::DeviceType deviceType() const = 0;
  virtual int rank() const = 0;       // global rank
  virtual int worldSize() const = 0;  // global size
  virtual std::chrono::milliseconds timeout() const = 0;

  // Where the agreement primitive (comm/agreement.h: the consistency check of the collectives
  // run on this transport) exchanges its digests, in THIS transport's rank space. nullptr: over
  // this transport itself, inline (CPU transports: inside run() bodies, in the worker's order).
  // Otherwise a host channel whose exchanges are never queued behind communication. The default
  // (agreement.cpp): inline on CPU, else the world CPU transport's host channel, which is right
  // for transports whose ranks are world ranks; a transport of a static group (ranks 0..k-1 of
  // the group) must return a channel over the group's own CPU transport.
  virtual std::shared_ptr<Transport> agreementChannel() const;

  // Launch a batch of P2P ops on the one global communicator. `what` names the caller (op and
  // group) for error messages. An empty batch is allowed and returns an already-complete exchange.
  virtual std::unique_ptr<PendingExchange> exchange(const std::vector<P2POp>& ops,
                                                    const std::string& what) = 0;

  // Launch a batch of P2P ops as one asynchronous operation and return its Work (a comm::Work):
  // it completes by itself once every op is done (is_completed() turns true without wait()),
  // wait(timeout) honours the timeout (else info.timeout) and names the peers that did not answer.
  //   CPU:  a completion thread of the transport waits for the batch, in issue order.
  //   CUDA: Work::wait() makes the caller's current stream wait on the batch's end event.
  virtual c10::intrusive_ptr<c10d::Work> post(const std::vector<P2POp>& ops, WorkInfo info) = 0;

  // Run `body` as one asynchronous operation (a collective of a dynamic group, say) and return its
  // Work. `outputs` are kept alive until completion and are the Work's result / future value;
  // `inputs` (tensors body reads that are not outputs) are kept alive until completion too (on
  // CUDA the communication stream may read them after the caller dropped its references).
  //   CPU:  body runs on the transport's worker thread (one thread: operations start in the order
  //         they are submitted); exceptions thrown by body fail the Work and surface in wait().
  //         In NCCL-order mode (gloo_transport.h) exchanges and posted batches queue there too.
  //   CUDA: the communication stream first waits on the caller's current stream, then body runs
  //         inline on the calling thread with the communication stream current (it only enqueues);
  //         Work::wait() makes the caller's current stream wait on the end event.
  // Inside body, exchange(...)->wait() and ATen ops are ordered correctly on both transports, and
  // run in the caller's thread-local state (at::ThreadLocalState; CPU: restored on the worker).
  virtual c10::intrusive_ptr<c10d::Work> run(WorkInfo info, std::vector<at::Tensor> outputs,
                                             std::function<void()> body,
                                             std::vector<at::Tensor> inputs = {}) = 0;

  // Convenience: one batched step of a ring. Sends `send` to `next`, receives into `recv` from
  // `prev` (either side may be undefined to skip it). next == prev is fine (2-member rings).
  std::unique_ptr<PendingExchange> ringStep(const at::Tensor& send, int next, const at::Tensor& recv,
                                            int prev, const std::string& what) {
    // One ring step, counted under the calling thread's TrafficScope (comm/traffic.h).
    countTraffic(TrafficScope::current(), send.defined() ? static_cast<int64_t>(send.nbytes()) : 0,
                 recv.defined() ? static_cast<int64_t>(recv.nbytes()) : 0);
    const auto ops = ringStepOps(send, next, recv, prev);
    countPeers(ops);
    return exchange(ops, what);
  }
  // Records the peers of `ops` on this transport (comm/traffic.h: countPeer).
  void countPeers(const std::vector<P2POp>& ops) const {
    for (const auto& op : ops) countPeer(this, op.peer);
  }
  static std::vector<P2POp> ringStepOps(const at::Tensor& send, int next, const at::Tensor& recv,
                                        int prev) {
    std::vector<P2POp> ops;
    if (send.defined()) ops.push_back({P2POp::kSend, next, send});
    if (recv.defined()) ops.push_back({P2POp::kRecv, prev, recv});
    return ops;
  }
};

// The transport of the process's world "bytescale" backend for a device type, registered when that
// backend is created (nullptr before init_process_group("bytescale") or after destruction).
// Ring attention and other ops look their transport up here, so they only need an ordered list of
// global ranks to describe their group. Defined in device_backends.cpp.
std::shared_ptr<Transport> worldTransport(c10::DeviceType device);
void registerWorldTransport(c10::DeviceType device, std::shared_ptr<Transport> transport);
void unregisterWorldTransport(c10::DeviceType device, const Transport* transport);

}  // namespace comm
}  // namespace bytescale
