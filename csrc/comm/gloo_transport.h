// The CPU transport: point-to-point messages over a torch ProcessGroupGloo (created through torch's
// Python binding, since Gloo's headers are not shipped in the wheel, and handed to C++ as a
// c10d::Backend), plus one worker thread that runs dynamic-group collectives asynchronously.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/transport.h"

namespace bytescale {
namespace comm {

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
  c10::intrusive_ptr<c10d::Work> run(const std::string& what, std::vector<at::Tensor> outputs,
                                     std::function<void()> body) override;

  const c10::intrusive_ptr<c10d::Backend>& gloo() const { return gloo_; }
  // Stop the worker (pending operations fail). Idempotent.
  void shutdown();

 private:
  // Gloo matches a receive by (source, tag). Each ordered pair of ranks keeps a message counter per
  // direction and per channel (0: the worker thread's collectives, 1: direct exchanges from caller
  // threads), and the counter is the tag: messages pair up by issue order, and the two channels
  // never steal each other's messages.
  int nextTag(int peer, bool send);

  c10::intrusive_ptr<c10d::Backend> gloo_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;

  std::mutex tag_mu_;
  std::vector<uint32_t> send_seq_[2];
  std::vector<uint32_t> recv_seq_[2];

  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;
  std::thread::id worker_id_;
};

}  // namespace comm
}  // namespace bytescale
