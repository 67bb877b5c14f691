#include "comm/agreement.h"

#include <ATen/ATen.h>

#include "comm/device_backends.h"
#include "comm/gloo_transport.h"

namespace bytescale {
namespace comm {

namespace {

// Groups up to this size exchange digests all-to-all in one round trip; larger ones use the ring
// all-gather (n-1 steps, but O(n) messages per rank instead of O(n^2) in all).
constexpr int kOneShotMax = 16;

// Keeps the world CPU transport alive while its host channel is used.
class HostChannel final : public Transport {
 public:
  explicit HostChannel(std::shared_ptr<GlooTransport> t) : t_(std::move(t)) {}
  c10::DeviceType deviceType() const override { return c10::DeviceType::CPU; }
  int rank() const override { return t_->rank(); }
  int worldSize() const override { return t_->worldSize(); }
  std::chrono::milliseconds timeout() const override { return t_->timeout(); }
  std::unique_ptr<PendingExchange> exchange(const std::vector<P2POp>& ops,
                                            const std::string& what) override {
    return t_->exchangeNow(ops, what);
  }
  c10::intrusive_ptr<c10d::Work> post(const std::vector<P2POp>&, WorkInfo info) override {
    TORCH_CHECK(false, "bytescale ", info.what, ": the host channel only exchanges");
  }
  c10::intrusive_ptr<c10d::Work> run(WorkInfo info, std::vector<at::Tensor>,
                                     std::function<void()>, std::vector<at::Tensor>) override {
    TORCH_CHECK(false, "bytescale ", info.what, ": the host channel only exchanges");
  }

 private:
  std::shared_ptr<GlooTransport> t_;
};

}  // namespace

std::shared_ptr<Transport> hostChannelOf(const std::shared_ptr<Transport>& cpu) {
  auto gloo = std::dynamic_pointer_cast<GlooTransport>(cpu);
  if (!gloo) return nullptr;
  return std::make_shared<HostChannel>(std::move(gloo));
}

std::shared_ptr<Transport> hostChannel() {
  return hostChannelOf(worldTransport(c10::DeviceType::CPU));
}

std::shared_ptr<Transport> Transport::agreementChannel() const {
  if (deviceType() == c10::DeviceType::CPU) return nullptr;
  return hostChannel();
}

std::vector<std::vector<int64_t>> agree(Transport& tr, const RankMap& g, AgreementKind kind,
                                        const std::vector<int64_t>& payload,
                                        const std::string& what) {
  g.requireMember(what);
  const int n = g.size(), me = g.myIndex();
  std::vector<int64_t> row = agreementRow(kind, payload, what);
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor mine = at::tensor(row, opts);
  at::Tensor table = at::empty({n, kAgreementLen}, opts);
  if (n == 1) {
    table[0].copy_(mine);
  } else if (n <= kOneShotMax) {
    table[me].copy_(mine);
    std::vector<P2POp> ops;
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      ops.push_back({P2POp::kSend, g.globalRank(j), mine, kAgreementTag});
      ops.push_back({P2POp::kRecv, g.globalRank(j), table[j], kAgreementTag});
    }
    tr.exchange(ops, what)->wait();
  } else {
    // The ring all-gather's schedule, with the agreement's tag on every message.
    const int me_ = g.myIndex();
    at::Tensor flat = table.view(-1);
    flat.narrow(0, me_ * kAgreementLen, kAgreementLen).copy_(mine);
    for (const auto& st : ringAllGatherSchedule(n, me_)) {
      std::vector<P2POp> ops{
          {P2POp::kSend, g.next(), flat.narrow(0, st.send_block * kAgreementLen, kAgreementLen),
           kAgreementTag},
          {P2POp::kRecv, g.prev(), flat.narrow(0, st.recv_block * kAgreementLen, kAgreementLen),
           kAgreementTag}};
      tr.exchange(ops, what)->wait();
    }
  }
  table = table.contiguous();
  const int64_t* rows = table.data_ptr<int64_t>();
  const int bad = firstKindMismatch(rows, n);
  // Reported relative to the group's first member, so every member raises the same message.
  TORCH_CHECK(bad < 0, "bytescale ", what, ": the ranks are in different agreements: rank ",
              g.globalRank(bad), " is in ",
              agreementKindName(rows[static_cast<int64_t>(bad) * kAgreementLen]), ", rank ",
              g.globalRank(0), " in ", agreementKindName(rows[0]),
              " (the ranks issued different operations, or in a different order)");
  std::vector<std::vector<int64_t>> out(n);
  for (int j = 0; j < n; ++j) {
    const int64_t* r = rows + static_cast<int64_t>(j) * kAgreementLen;
    out[j].assign(r + 1, r + kAgreementLen);
  }
  return out;
}

}  // namespace comm
}  // namespace bytescale
