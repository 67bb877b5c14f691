#include "comm/gloo_transport.h"

#include <sstream>

#include "comm/work.h"

namespace bytescale {
namespace comm {

namespace {

// Tags of bytescale's internal messages live above user tags (which are small in practice).
constexpr uint32_t kInternalTagBase = 0x40000000u;
constexpr uint32_t kTagMask = 0x1FFFFFFFu;

class GlooExchange final : public PendingExchange {
 public:
  struct Item {
    c10::intrusive_ptr<c10d::Work> work;
    P2POp::Kind kind;
    int peer;
    int64_t bytes;
  };
  GlooExchange(std::vector<Item> items, std::string what)
      : items_(std::move(items)), what_(std::move(what)) {}
  ~GlooExchange() override {
    // Never leave Gloo writing into freed memory: an exchange dropped without wait() is waited
    // for here (errors are swallowed; the owner chose not to look).
    try {
      wait();
    } catch (...) {
    }
  }
  void wait() override {
    std::exception_ptr first;
    std::string msg;
    for (auto& it : items_) {
      if (!it.work) continue;
      try {
        it.work->wait();
      } catch (const std::exception& e) {
        if (!first) {
          first = std::current_exception();
          std::ostringstream os;
          os << "bytescale " << what_ << ": " << (it.kind == P2POp::kSend ? "send to" : "receive from")
             << " rank " << it.peer << " (" << it.bytes << " bytes) failed: " << e.what();
          msg = os.str();
        }
      }
      it.work.reset();
    }
    items_.clear();
    if (first) throw std::runtime_error(msg);
  }

 private:
  std::vector<Item> items_;
  std::string what_;
};

}  // namespace

GlooTransport::GlooTransport(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int world_size,
                             std::chrono::milliseconds timeout)
    : gloo_(std::move(gloo)), rank_(rank), world_size_(world_size), timeout_(timeout) {
  TORCH_CHECK(gloo_, "bytescale: GlooTransport needs a Gloo backend");
  for (int c = 0; c < 2; ++c) {
    send_seq_[c].assign(world_size, 0);
    recv_seq_[c].assign(world_size, 0);
  }
  worker_ = std::thread([this] {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lk(q_mu_);
        q_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  });
  worker_id_ = worker_.get_id();
}

GlooTransport::~GlooTransport() { shutdown(); }

void GlooTransport::shutdown() {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    if (stop_) return;
    stop_ = true;
  }
  q_cv_.notify_all();
  if (worker_.joinable()) {
    if (std::this_thread::get_id() == worker_id_)
      worker_.detach();
    else
      worker_.join();
  }
}

int GlooTransport::nextTag(int peer, bool send) {
  int channel = std::this_thread::get_id() == worker_id_ ? 0 : 1;
  std::lock_guard<std::mutex> g(tag_mu_);
  uint32_t& seq = send ? send_seq_[channel][peer] : recv_seq_[channel][peer];
  uint32_t tag = kInternalTagBase | (static_cast<uint32_t>(channel) << 29) | (seq & kTagMask);
  ++seq;
  return static_cast<int>(tag);
}

std::unique_ptr<PendingExchange> GlooTransport::exchange(const std::vector<P2POp>& ops,
                                                         const std::string& what) {
  std::vector<GlooExchange::Item> items;
  items.reserve(ops.size());
  for (const auto& op : ops) {
    TORCH_CHECK(op.peer >= 0 && op.peer < world_size_, "bytescale ", what, ": peer rank ",
                op.peer, " outside [0, ", world_size_, ")");
    TORCH_CHECK(op.peer != rank_, "bytescale ", what, ": rank ", rank_,
                " cannot send to or receive from itself");
    TORCH_CHECK(op.tensor.defined(), "bytescale ", what, ": undefined tensor for peer ", op.peer);
    TORCH_CHECK(op.tensor.device().is_cpu(), "bytescale ", what,
                ": the CPU transport got a tensor on ", op.tensor.device());
    TORCH_CHECK(op.tensor.is_contiguous(), "bytescale ", what,
                ": point-to-point tensors must be contiguous");
    if (op.tensor.numel() == 0) continue;  // nothing to move; both sides skip symmetrically
    std::vector<at::Tensor> ts{op.tensor};
    bool send = op.kind == P2POp::kSend;
    int tag = op.tag >= 0 ? op.tag : nextTag(op.peer, send);
    auto work = send ? gloo_->send(ts, op.peer, tag) : gloo_->recv(ts, op.peer, tag);
    items.push_back({std::move(work), op.kind, op.peer,
                     static_cast<int64_t>(op.tensor.numel() * op.tensor.element_size())});
  }
  return std::make_unique<GlooExchange>(std::move(items), what);
}

c10::intrusive_ptr<c10d::Work> GlooTransport::run(const std::string& what,
                                                  std::vector<at::Tensor> outputs,
                                                  std::function<void()> body) {
  auto work = c10::make_intrusive<FutureWork>(rank_, c10d::OpType::UNKNOWN, what, outputs);
  {
    std::lock_guard<std::mutex> g(q_mu_);
    TORCH_CHECK(!stop_, "bytescale ", what, ": the backend has been shut down");
    queue_.push_back([work, what, body = std::move(body)] {
      try {
        body();
        work->markDone();
      } catch (const std::exception& e) {
        std::string msg = e.what();
        if (msg.rfind("bytescale", 0) != 0) msg = "bytescale " + what + " failed: " + msg;
        work->markFailed(std::make_exception_ptr(std::runtime_error(msg)));
      } catch (...) {
        work->markFailed(std::current_exception());
      }
    });
  }
  q_cv_.notify_one();
  return work;
}

}  // namespace comm
}  // namespace bytescale
