#include "comm/staged_transport.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "comm/agreement.h"
#include "comm/group_ops.h"
#include "comm/work.h"

namespace bytescale {
namespace comm {

namespace {

// Waits on the host until the work queued on the current stream of `d` is done (no-op on CPU).
void syncCurrentStream(const c10::Device& d) {
  if (d.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(d.type());
  impl.getStream(d).synchronize();
}

// A host buffer for `t` (pinned when `t` lives on an accelerator).
at::Tensor hostLike(const at::Tensor& t) {
  auto opts = t.options().device(at::kCPU);
  if (!t.is_cpu()) opts = opts.pinned_memory(true);
  return at::empty(t.sizes(), opts);
}

struct Staged {
  std::vector<P2POp> host_ops;
  std::vector<std::pair<at::Tensor, at::Tensor>> recvs;  // (device tensor, host buffer)
};

// Copies the sends to the host (after the caller's stream) and allocates the receive buffers.
Staged stage(const std::vector<P2POp>& ops, c10::DeviceType device, const std::string& what) {
  Staged s;
  bool synced = false;
  for (const auto& op : ops) {
    TORCH_CHECK(op.tensor.defined() && op.tensor.device().type() == device &&
                    op.tensor.is_contiguous(),
                "bytescale ", what, ": the staged transport needs defined, contiguous ",
                c10::DeviceTypeName(device), " tensors");
    if (!synced) {
      syncCurrentStream(op.tensor.device());
      synced = true;
    }
    at::Tensor host = hostLike(op.tensor);
    if (op.kind == P2POp::kSend)
      host.copy_(op.tensor);
    else
      s.recvs.emplace_back(op.tensor, host);
    s.host_ops.push_back({op.kind, op.peer, host, op.tag});
  }
  return s;
}

// Copies the received bytes into the device tensors (synchronously on the current stream).
void unstage(const std::vector<std::pair<at::Tensor, at::Tensor>>& recvs) {
  for (const auto& [dev, host] : recvs) {
    const c10::OptionalDeviceGuard guard(dev.device());
    dev.copy_(host);
    syncCurrentStream(dev.device());
  }
}

class StagedExchange final : public PendingExchange {
 public:
  StagedExchange(std::unique_ptr<PendingExchange> inner, Staged staged)
      : inner_(std::move(inner)), staged_(std::move(staged)) {}
  void wait() override {
    if (done_) return;
    inner_->wait();
    done_ = true;
    unstage(staged_.recvs);
  }

 private:
  std::unique_ptr<PendingExchange> inner_;
  Staged staged_;
  bool done_ = false;
};

std::vector<c10::Device> futureDevices(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (t.defined() && !t.is_cpu()) return {t.device()};
  return {};
}

// Completes `outer` when `inner` completes, after `then` ran (its error fails `outer`).
void chain(const c10::intrusive_ptr<c10d::Work>& inner, const c10::intrusive_ptr<Work>& outer,
           std::function<void()> then) {
  inner->getFuture()->addCallback([outer, then = std::move(then)](c10::ivalue::Future& f) {
    std::exception_ptr error;
    if (f.hasError()) {
      error = f.exception_ptr();
    } else if (then) {
      try {
        then();
      } catch (...) {
        error = std::current_exception();
      }
    }
    outer->complete(error);
  });
}

}  // namespace

StagedTransport::StagedTransport(c10::DeviceType device, std::shared_ptr<Transport> cpu)
    : device_(device), cpu_(std::move(cpu)), host_(hostChannelOf(cpu_)) {
  TORCH_CHECK(cpu_ && cpu_->deviceType() == c10::DeviceType::CPU && host_,
              "bytescale: the staged transport needs the group's CPU (Gloo) transport");
}

// The host channel of the CPU transport it stages over: the world's for the world backend, the
// static group's own (ranks 0..k-1 of the group) for a static group's plug-in, so a check of
// group [0, 2] pairs world ranks 0 and 2, never 0 and 1.
std::shared_ptr<Transport> StagedTransport::agreementChannel() const { return host_; }

std::unique_ptr<PendingExchange> StagedTransport::exchange(const std::vector<P2POp>& ops,
                                                           const std::string& what) {
  Staged s = stage(ops, device_, what);
  auto inner = cpu_->exchange(s.host_ops, what);
  return std::make_unique<StagedExchange>(std::move(inner), std::move(s));
}

c10::intrusive_ptr<c10d::Work> StagedTransport::post(const std::vector<P2POp>& ops,
                                                     WorkInfo info) {
  std::vector<at::Tensor> tensors;
  for (const auto& op : ops) tensors.push_back(op.tensor);
  Staged s = stage(ops, device_, info.what);
  auto outer = c10::make_intrusive<Work>(rank(), info, tensors, futureDevices(tensors));
  auto inner = cpu_->post(s.host_ops, std::move(info));
  auto recvs = std::move(s.recvs);
  chain(inner, outer, [recvs] { unstage(recvs); });
  return outer;
}

c10::intrusive_ptr<c10d::Work> StagedTransport::run(WorkInfo info, std::vector<at::Tensor> outputs,
                                                    std::function<void()> body,
                                                    std::vector<at::Tensor> inputs) {
  std::optional<c10::Device> dev;
  for (const auto* list : {&outputs, &inputs})
    for (const auto& t : *list)
      if (!dev && t.defined() && t.device().type() == device_) dev = t.device();
  if (dev) syncCurrentStream(*dev);  // the body reads what the caller's stream produced
  auto outer = c10::make_intrusive<Work>(rank(), info, outputs, futureDevices(outputs));
  auto inner = cpu_->run(
      std::move(info), {},
      [dev, body = std::move(body), inputs, outputs] {
        const c10::OptionalDeviceGuard guard(dev);
        body();
        if (dev) syncCurrentStream(*dev);  // results in place before the Work completes
      });
  chain(inner, outer, nullptr);
  return outer;
}

namespace {

class StagedBackend final : public CollectiveBackend {
 public:
  StagedBackend(std::shared_ptr<const RankMap> world, std::chrono::milliseconds timeout,
                std::shared_ptr<StagedTransport> tr)
      : CollectiveBackend(std::move(world), "world group", timeout), tr_(std::move(tr)) {}

  const std::string getBackendName() const override { return "bytescale-staged"; }

  c10::intrusive_ptr<c10d::Work> execute(Collective c) override {
    auto inf = info(c);
    std::vector<at::Tensor> outputs = c.outputs, inputs = c.inputs;
    auto tr = tr_;
    auto world = rankMapPtr();
    return tr_->run(std::move(inf), std::move(outputs),
                    [tr, world, c = std::move(c)] { group_ops::run(*tr, *world, c); },
                    std::move(inputs));
  }
  std::shared_ptr<Transport> p2pTransport(c10::DeviceType device,
                                          const std::string& what) override {
    TORCH_CHECK(device == tr_->deviceType(), "bytescale ", what, ": the staged backend takes ",
                c10::DeviceTypeName(tr_->deviceType()), " tensors, got ",
                c10::DeviceTypeName(device));
    return tr_;
  }
  void eagerConnectSingleDevice(at::Device) override {}  // nothing to create

 private:
  std::shared_ptr<StagedTransport> tr_;
};

}  // namespace

DeviceBackend makeStagedBackend(c10::DeviceType device, const DeviceBackendOptions& o) {
  TORCH_CHECK(o.cpu, "bytescale: the staged ", c10::DeviceTypeName(device),
              " transport needs the group's CPU transport (BYTESCALE_CUDA_TRANSPORT=staged)");
  std::vector<int> ranks(o.size);
  for (int r = 0; r < o.size; ++r) ranks[r] = r;
  auto tr = std::make_shared<StagedTransport>(device, o.cpu);
  DeviceBackend plugin;
  plugin.backend = c10::make_intrusive<StagedBackend>(
      std::make_shared<const RankMap>(std::move(ranks), o.size, o.rank), o.timeout, tr);
  plugin.transport = tr;
  return plugin;
}

}  // namespace comm
}  // namespace bytescale
