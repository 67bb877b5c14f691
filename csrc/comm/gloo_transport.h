// The CPU transport: point-to-point messages over a torch ProcessGroupGloo (created through torch's
// Python binding, since Gloo's headers are not shipped in the wheel, and handed to C++ as a
// c10d::Backend), one worker thread that runs collectives asynchronously (run()), and a few
// waiter threads that complete the Works of posted point-to-point batches (post()), so their
// is_completed() turns true without anyone calling wait().
//
// NCCL-order mode (BYTESCALE_NCCL_ORDER=1, common/env.h; for tests): CUDA's execution model. NCCL
// runs every operation of a communicator in issue order on one CUDA stream, each one blocking the
// stream until every rank it involves has joined. In this mode the worker thread is that stream:
// exchange() and post() from any other thread are queued behind the collectives (world and
// dynamic-group) and exchanges issued before them and run there one at a time, and the world
// backend queues Gloo's native collectives too. A rank whose operations form a cycle with a
// peer's on one NCCL stream then deadlocks here as well, and the waits raise the transport's
// timeout error naming the operation the queue is stuck behind. Cross-rank agreements
// (comm/agreement.h: host channels) use exchangeNow() in both modes: on CUDA they are host
// exchanges outside the NCCL stream too.
#pragma once

#include <memory>
#include <functional>
#include <mutex>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/task_queue.h"
#include "comm/transport.h"
#include "comm/work.h"

namespace bytescale {
namespace comm {

struct ExchangeRegistry;  // live exchanges, aborted at shutdown (gloo_transport.cpp)
struct WorkerStatus;      // what the worker runs and waits for, for timeout errors

class GlooTransport final : public Transport {
 public:
  GlooTransport(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int world_size,
                std::chrono::milliseconds timeout);
  ~GlooTransport() override;

  c10::DeviceType deviceType() const override { return c10::DeviceType::CPU; }
  int rank() const override { return rank_; }
  int worldSize() const override { return world_size_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<PendingExchange> exchange(const std::vector<P2POp>& ops,
                                            const std::string& what) override;
  // Posts the ops to Gloo now, whatever the mode (exchange() outside NCCL-order mode).
  std::unique_ptr<PendingExchange> exchangeNow(const std::vector<P2POp>& ops,
                                               const std::string& what);
  // True in NCCL-order mode (BYTESCALE_NCCL_ORDER=1, read once per process).
  bool inOrder() const { return in_order_; }
  c10::intrusive_ptr<c10d::Work> post(const std::vector<P2POp>& ops, WorkInfo info) override;
  c10::intrusive_ptr<c10d::Work> run(WorkInfo info, std::vector<at::Tensor> outputs,
                                     std::function<void()> body,
                                     std::vector<at::Tensor> inputs = {}) override;

  // A receive from any rank with the user tag `tag` (Gloo's recvAnysource); the returned
  // AnySourceWork completes (is_completed() turns true by itself) and names the sender.
  c10::intrusive_ptr<c10d::Work> postRecvAnysource(const at::Tensor& tensor, int tag,
                                                   WorkInfo info);

  // Marks the worker as waiting inside a Gloo-native operation (for the timeout error of the Work
  // it runs); the world backend calls it around its Gloo collectives. Cleared by the next task.
  void noteNativeWait(const std::string& what);

  const c10::intrusive_ptr<c10d::Backend>& gloo() const { return gloo_; }
  // Stops the threads: queued collectives fail ("shut down"), transfers still in flight are
  // aborted (their waits raise). Idempotent; safe from any thread.
  void shutdown();

 private:
  // Gloo matches a receive by (source, tag). Each ordered pair of ranks keeps a message counter per
  // direction and per channel (0: the worker thread's operations, 1: direct exchanges from caller
  // threads, 2 and 3: the same for agreements, comm/agreement.h), and the counter is the tag:
  // messages pair up by issue order, and channels never steal each other's messages.
  int nextTag(int peer, bool send, bool agreement);

  // Completes `work` when `ex`'s transfers finish (on a waiter thread), after `on_done` has run;
  // raises DistBackendError naming `what` when the transport has been shut down.
  void completeWhenDone(const c10::intrusive_ptr<Work>& work, std::shared_ptr<PendingExchange> ex,
                        const std::string& what, std::function<void()> on_done);

  c10::intrusive_ptr<c10d::Backend> gloo_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;

  std::mutex tag_mu_;
  std::vector<uint32_t> send_seq_[4];
  std::vector<uint32_t> recv_seq_[4];

  bool in_order_;
  std::shared_ptr<ExchangeRegistry> live_;
  std::shared_ptr<WorkerStatus> status_;
  TaskQueue worker_{1};    // collectives, in submission order
  TaskQueue waiters_{32};  // completion of posted P2P batches, independently of each other
};

}  // namespace comm
}  // namespace bytescale
