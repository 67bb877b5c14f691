#include "comm/gloo_transport.h"

#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <unordered_set>

#include "comm/agreement.h"
#include "comm/work.h"
#include "common/handoff.h"
#include "common/env.h"

namespace bytescale {
namespace comm {

namespace {

// Tags of bytescale's internal messages live above user tags (which are small in practice): bit
// 30 set, the channel in bits 27-28, the per-pair sequence in bits 0-26.
constexpr uint32_t kInternalTagBase = 0x40000000u;
constexpr int kChannelShift = 27;
constexpr uint32_t kTagMask = (1u << kChannelShift) - 1;

// Gloo transfers that were aborted while a peer could still write into them: kept for the rest of
// the process instead of freed (shutdown with transfers in flight only).
void bury(std::vector<c10::intrusive_ptr<c10d::Work>> works) {
  static std::mutex mu;
  static auto* graveyard = new std::vector<c10::intrusive_ptr<c10d::Work>>();
  std::lock_guard<std::mutex> g(mu);
  graveyard->insert(graveyard->end(), works.begin(), works.end());
}

// "bytescale <what>: send to rank 3 (512 bytes) failed: <failure>": how every failed transfer of
// an exchange is reported, whether Gloo refused to post it or it failed while waited for.
std::string transferFailure(const std::string& what, P2POp::Kind kind, int peer, int64_t bytes,
                            const std::string& failure) {
  std::ostringstream os;
  os << "bytescale " << what << ": " << (kind == P2POp::kSend ? "send to" : "receive from")
     << (peer < 0 ? std::string(" any rank") : " rank " + std::to_string(peer)) << " (" << bytes
     << " bytes) failed: " << failure;
  return os.str();
}

// An exception's text without c10's source-location suffix.
std::string errorText(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  return ce ? ce->msg() : std::string(e.what());
}

}  // namespace

// The ops of one exchange, and how many of them are known to be complete (in order), shared with
// the timeout reports of the Works waiting for it.
struct ExchangeState {
  struct Item {
    P2POp::Kind kind;
    int peer;
    int64_t bytes;
  };
  std::vector<Item> items;
  std::atomic<size_t> done{0};

  std::string pending() const {
    std::ostringstream os;
    size_t first = done.load();
    for (size_t i = first; i < items.size(); ++i)
      os << (i > first ? ", " : "") << (items[i].kind == P2POp::kSend ? "send to" : "receive from")
         << (items[i].peer < 0 ? std::string(" any rank") : " rank " + std::to_string(items[i].peer))
         << " (" << items[i].bytes << " bytes)";
    return first >= items.size() ? std::string("nothing (the transfers are done)") : os.str();
  }
};

class GlooExchange;

// Exchanges in flight, so that shutdown can abort them (their waits then return at once).
struct ExchangeRegistry {
  std::mutex mu;
  std::unordered_set<GlooExchange*> live;
  bool aborted = false;
  void add(GlooExchange* e);
  void remove(GlooExchange* e) {
    std::lock_guard<std::mutex> g(mu);
    live.erase(e);
  }
  void abortAll();
};

// What the worker thread runs and waits for.
struct WorkerStatus {
  std::mutex mu;
  const void* running = nullptr;  // the Work whose body runs
  std::string running_what;
  std::shared_ptr<ExchangeState> blocked;  // the exchange the body waits for
  std::string native;                      // or the Gloo-native operation it waits in

  void start(const void* work, const std::string& what) {
    std::lock_guard<std::mutex> g(mu);
    running = work;
    running_what = what;
    blocked.reset();
    native.clear();
  }
  void stop() { start(nullptr, ""); }
  std::string waitingFor() const {  // mu held
    if (blocked) return "waiting for " + blocked->pending();
    if (!native.empty()) return "waiting inside " + native + " for the other members";
    return "running on this rank";
  }
  std::string describe(const void* work) {
    std::lock_guard<std::mutex> g(mu);
    if (running == work) return waitingFor();
    if (running)
      return "queued behind '" + running_what + "', which is " + waitingFor();
    return "queued";
  }
};

class GlooExchange final : public PendingExchange {
 public:
  GlooExchange(std::vector<c10::intrusive_ptr<c10d::Work>> works,
               std::shared_ptr<ExchangeState> state, std::string what,
               std::shared_ptr<ExchangeRegistry> registry, std::shared_ptr<WorkerStatus> status)
      : works_(std::move(works)),
        state_(std::move(state)),
        what_(std::move(what)),
        registry_(std::move(registry)),
        status_(std::move(status)) {
    registry_->add(this);
  }
  ~GlooExchange() override {
    // Never leave Gloo writing into freed memory: an exchange dropped without wait() is waited
    // for here (errors are swallowed; the owner chose not to look).
    if (!waited_) {
      try {
        wait();
      } catch (...) {
      }
    }
    registry_->remove(this);
    if (aborted_) bury(std::move(works_));
  }

  void wait() override {
    if (waited_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    if (status_) {
      std::lock_guard<std::mutex> g(status_->mu);
      status_->blocked = state_;
    }
    std::string msg;
    for (size_t i = 0; i < works_.size(); ++i) {
      const auto& it = state_->items[i];
      std::string failure;
      try {
        if (!works_[i]->wait()) {
          aborted_ = true;
          failure = "aborted (the backend was shut down)";
        }
      } catch (const std::exception& e) {
        failure = errorText(e);
      }
      if (!failure.empty() && msg.empty()) msg = transferFailure(what_, it.kind, it.peer, it.bytes, failure);
      if (failure.empty()) state_->done.store(i + 1);
    }
    if (status_) {
      std::lock_guard<std::mutex> g(status_->mu);
      status_->blocked.reset();
    }
    waited_ = true;
    if (!msg.empty()) {
      error_ = std::make_exception_ptr(
          c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg));
      std::rethrow_exception(error_);
    }
  }

  // Interrupts the waits (called with the registry's lock held; works_ never changes while the
  // exchange is registered).
  void abort() {
    for (const auto& w : works_) {
      try {
        w->abort();
      } catch (...) {
      }
    }
  }

  // Gives up on the transfers (a later op could not be posted): aborts and reaps them without
  // reporting; the destructor buries the aborted Works.
  void abandon() {
    abort();
    try {
      wait();
    } catch (...) {
    }
    aborted_ = true;
  }

  const std::shared_ptr<ExchangeState>& state() const { return state_; }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::shared_ptr<ExchangeState> state_;
  std::string what_;
  std::shared_ptr<ExchangeRegistry> registry_;
  std::shared_ptr<WorkerStatus> status_;  // set on the worker thread only
  bool waited_ = false;
  bool aborted_ = false;
  std::exception_ptr error_;
};

void ExchangeRegistry::add(GlooExchange* e) {
  std::lock_guard<std::mutex> g(mu);
  live.insert(e);
  if (aborted) e->abort();
}

void ExchangeRegistry::abortAll() {
  std::lock_guard<std::mutex> g(mu);
  aborted = true;
  for (auto* e : live) e->abort();
}

// An exchange queued on the worker (NCCL-order mode): its Work completes when the worker has
// posted the ops and they finished. Dropped without wait(), it is waited for (as GlooExchange).
class QueuedExchange final : public PendingExchange {
 public:
  explicit QueuedExchange(c10::intrusive_ptr<c10d::Work> work) : work_(std::move(work)) {}
  ~QueuedExchange() override {
    if (!waited_) {
      try {
        work_->wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    waited_ = true;
    work_->wait();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  bool waited_ = false;
};

namespace {

WorkInfo exchangeInfo(const std::vector<P2POp>& ops, const std::string& what,
                      std::chrono::milliseconds timeout) {
  WorkInfo info;
  info.what = what;
  info.timeout = timeout;
  for (const auto& op : ops)
    if (std::find(info.peers.begin(), info.peers.end(), op.peer) == info.peers.end())
      info.peers.push_back(op.peer);
  return info;
}

}  // namespace

// ---- GlooTransport --------------------------------------------------------------------------

GlooTransport::GlooTransport(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int world_size,
                             std::chrono::milliseconds timeout)
    : gloo_(std::move(gloo)),
      rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      in_order_(env::knobs().nccl_order),
      live_(std::make_shared<ExchangeRegistry>()),
      status_(std::make_shared<WorkerStatus>()) {
  TORCH_CHECK(gloo_, "bytescale: GlooTransport needs a Gloo backend");
  for (int c = 0; c < 4; ++c) {
    send_seq_[c].assign(world_size, 0);
    recv_seq_[c].assign(world_size, 0);
  }
}

GlooTransport::~GlooTransport() { shutdown(); }

void GlooTransport::shutdown() {
  live_->abortAll();      // unblocks the worker's running exchange and the waiters
  worker_.close(true);    // queued collectives fail; the running one ends
  waiters_.close(false);  // the posted batches complete (aborted ones with an error)
}

int GlooTransport::nextTag(int peer, bool send, bool agreement) {
  const int channel = (agreement ? 2 : 0) + (worker_.onQueueThread() ? 0 : 1);
  std::lock_guard<std::mutex> g(tag_mu_);
  uint32_t& seq = send ? send_seq_[channel][peer] : recv_seq_[channel][peer];
  uint32_t tag =
      kInternalTagBase | (static_cast<uint32_t>(channel) << kChannelShift) | (seq & kTagMask);
  ++seq;
  return static_cast<int>(tag);
}

namespace {

// Every op is checked before any is posted: a half-posted exchange cannot be taken back.
void checkOps(const std::vector<P2POp>& ops, int rank, int world_size, const std::string& what) {
  for (const auto& op : ops) {
    TORCH_CHECK(op.peer >= 0 && op.peer < world_size && op.peer != rank, "bytescale ", what,
                ": peer rank ", op.peer, " is not another rank of the world of ", world_size);
    TORCH_CHECK(op.tensor.defined() && op.tensor.device().is_cpu() && op.tensor.is_contiguous(),
                "bytescale ", what, ": the CPU transport needs defined, contiguous CPU tensors");
  }
}

}  // namespace

std::unique_ptr<PendingExchange> GlooTransport::exchange(const std::vector<P2POp>& ops,
                                                         const std::string& what) {
  if (!in_order_ || worker_.onQueueThread()) return exchangeNow(ops, what);
  // NCCL-order mode: behind everything this rank issued before, on the worker.
  checkOps(ops, rank_, world_size_, what);
  return std::make_unique<QueuedExchange>(
      run(exchangeInfo(ops, what, timeout_), {}, [this, ops, what] { exchangeNow(ops, what)->wait(); }));
}

std::unique_ptr<PendingExchange> GlooTransport::exchangeNow(const std::vector<P2POp>& ops,
                                                            const std::string& what) {
  checkOps(ops, rank_, world_size_, what);
  auto state = std::make_shared<ExchangeState>();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& op : ops) {
    if (op.tensor.numel() == 0) continue;  // nothing to move; both sides skip symmetrically
    std::vector<at::Tensor> ts{handOff(op.tensor)};  // Gloo's threads may free it (common/handoff.h)
    bool send = op.kind == P2POp::kSend;
    int tag = op.tag >= 0 ? op.tag : nextTag(op.peer, send, op.tag == kAgreementTag);
    const int64_t bytes = static_cast<int64_t>(op.tensor.numel() * op.tensor.element_size());
    try {
      works.push_back(send ? gloo_->send(ts, op.peer, tag) : gloo_->recv(ts, op.peer, tag));
    } catch (const std::exception& e) {
      // Gloo refuses to post on a pair whose connection is already gone (a peer that died
      // earlier): named like a failed wait. The ops posted so far are aborted and buried.
      const std::string msg = transferFailure(what, op.kind, op.peer, bytes, errorText(e));
      {
        GlooExchange posted(std::move(works), std::move(state), what, live_, nullptr);
        posted.abandon();
      }
      TORCH_CHECK_WITH(DistBackendError, false, msg);
    }
    state->items.push_back({op.kind, op.peer, bytes});
  }
  return std::make_unique<GlooExchange>(std::move(works), std::move(state), what, live_,
                                        worker_.onQueueThread() ? status_ : nullptr);
}

// Completes `work` when `ex`'s transfers finish (on a waiter thread), after `on_done` has run.
void GlooTransport::completeWhenDone(const c10::intrusive_ptr<Work>& work,
                                     std::shared_ptr<PendingExchange> ex, const std::string& what,
                                     std::function<void()> on_done) {
  bool queued = waiters_.push([work, ex, on_done = std::move(on_done),
                               caller = at::ThreadLocalState()](bool) {
    at::ThreadLocalStateGuard tls(caller);  // the Work's callbacks run in the caller's modes
    std::exception_ptr error;
    try {
      ex->wait();
      if (on_done) on_done();
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
  });
  if (!queued) {
    // Shut down: the transfers were aborted at registration; their wait returns at once.
    try {
      ex->wait();
    } catch (...) {
    }
    TORCH_CHECK_WITH(DistBackendError, false, "bytescale ", what,
                     ": the backend has been shut down");
  }
}

c10::intrusive_ptr<c10d::Work> GlooTransport::post(const std::vector<P2POp>& ops, WorkInfo info) {
  std::vector<at::Tensor> tensors;
  for (const auto& op : ops) tensors.push_back(op.tensor);
  if (in_order_ && !worker_.onQueueThread()) {  // NCCL-order mode: queued (see exchange())
    checkOps(ops, rank_, world_size_, info.what);
    const std::string w = info.what;
    return run(std::move(info), std::move(tensors), [this, ops, w] { exchangeNow(ops, w)->wait(); });
  }
  const std::string what = info.what;
  auto work = c10::make_intrusive<Work>(rank_, std::move(info), std::move(tensors));
  std::shared_ptr<PendingExchange> ex = exchangeNow(ops, what);
  auto state = static_cast<GlooExchange*>(ex.get())->state();
  if (state->items.empty()) {
    work->complete();
    return work;
  }
  work->setStallReporter([state] { return "waiting for " + state->pending(); });
  completeWhenDone(work, std::move(ex), what, nullptr);
  return work;
}

c10::intrusive_ptr<c10d::Work> GlooTransport::postRecvAnysource(const at::Tensor& tensor, int tag,
                                                                WorkInfo info) {
  const std::string what = info.what;
  TORCH_CHECK(tensor.defined() && tensor.device().is_cpu() && tensor.is_contiguous(), "bytescale ",
              what, ": the CPU transport needs a defined, contiguous CPU tensor");
  auto work = c10::make_intrusive<AnySourceWork>(rank_, std::move(info),
                                                 std::vector<at::Tensor>{tensor});
  std::vector<at::Tensor> ts{handOff(tensor)};
  c10::intrusive_ptr<c10d::Work> native;
  try {
    native = gloo_->recvAnysource(ts, tag);
  } catch (const std::exception& e) {
    TORCH_CHECK_WITH(DistBackendError, false,
                     transferFailure(what, P2POp::kRecv, -1,
                                     static_cast<int64_t>(tensor.numel() * tensor.element_size()),
                                     errorText(e)));
  }
  auto state = std::make_shared<ExchangeState>();
  state->items.push_back(
      {P2POp::kRecv, -1, static_cast<int64_t>(tensor.numel() * tensor.element_size())});
  std::shared_ptr<PendingExchange> ex = std::make_shared<GlooExchange>(
      std::vector<c10::intrusive_ptr<c10d::Work>>{native}, state, what, live_, nullptr);
  work->setStallReporter([state] { return "waiting for " + state->pending(); });
  completeWhenDone(work, std::move(ex), what,
                   [work, native] { work->setSource(native->sourceRank()); });
  return work;
}

c10::intrusive_ptr<c10d::Work> GlooTransport::run(WorkInfo info, std::vector<at::Tensor> outputs,
                                                  std::function<void()> body,
                                                  std::vector<at::Tensor>) {  // body holds inputs
  const std::string what = info.what;
  auto work = c10::make_intrusive<Work>(rank_, std::move(info), std::move(outputs));
  const void* id = work.get();
  std::weak_ptr<WorkerStatus> weak = status_;
  work->setStallReporter([weak, id] {
    auto s = weak.lock();
    return s ? s->describe(id) : std::string("the transport was shut down");
  });
  auto status = status_;
  // The caller's thread-local state (grad and inference mode, autocast, dispatch-key TLS, the
  // profiler: at::ThreadLocalState), captured now and restored around the body and the Work's
  // completion on the worker, as ProcessGroupGloo does on its threads: every collective the worker
  // runs (bytescale's own algorithms on any group, coalesced ops, the consistency check and the
  // Gloo collectives it issues, which capture it again) sees the modes of the thread that issued it.
  bool queued = worker_.push([work, id, what, status, body = std::move(body),
                              caller = at::ThreadLocalState()](bool cancelled) {
    at::ThreadLocalStateGuard tls(caller);
    if (cancelled) {
      work->complete(std::make_exception_ptr(c10::DistBackendError(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
          "bytescale " + what + ": the backend was shut down before the operation started")));
      return;
    }
    status->start(id, what);
    std::exception_ptr error;
    try {
      body();
    } catch (...) {
      error = describeFailure(std::current_exception(), what);
    }
    status->stop();
    work->complete(error);
  });
  TORCH_CHECK_WITH(DistBackendError, queued, "bytescale ", what,
                   ": the backend has been shut down");
  return work;
}

void GlooTransport::noteNativeWait(const std::string& what) {
  std::lock_guard<std::mutex> g(status_->mu);
  status_->native = what;
}

}  // namespace comm
}  // namespace bytescale
