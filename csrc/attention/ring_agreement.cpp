#include "attention/ring_agreement.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <cstring>
#include <sstream>

#include "comm/agreement.h"
#include "comm/checks.h"
#include "common/env.h"

namespace bytescale {
namespace attention {

namespace {

// Digest fields. kStatus is not compared: it is the length of the member's input error (0: ok).
enum Field : int {
  kTag = 0, kStatus, kDocCount, kDocSum, kDocHash, kRingSize, kRingHash, kDtype, kQHeads, kKvHeads,
  kHeadDim, kCausal, kScale, kBf16
};
static_assert(kBf16 + 1 == kDigestLen, "digest layout");

constexpr int64_t kTagValue = 0x52494e4701;  // "RING" + layout version 1
constexpr size_t kMaxErrorBytes = 4096;
constexpr size_t kMaxListed = 24;            // values of a list shown in a message

std::atomic<bool>& flag() {
  static std::atomic<bool> f{env::knobs().check_ring};
  return f;
}

int64_t hashOf(const std::vector<int64_t>& v) {
  uint64_t h = comm::fnv1a(comm::kFnvOffset, v.size());
  for (auto x : v) h = comm::fnv1a(h, static_cast<uint64_t>(x));
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

std::string listOf(const int64_t* p, int64_t n) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < n && i < static_cast<int64_t>(kMaxListed); ++i) os << (i ? ", " : "") << p[i];
  if (n > static_cast<int64_t>(kMaxListed)) os << ", ... (" << n << " values)";
  os << "]";
  return os.str();
}

const char* fieldName(int f) {
  switch (f) {
    case kTag: return "check version";
    case kDocCount: case kDocSum: case kDocHash: return "documents";
    case kRingSize: case kRingHash: return "ring order";
    case kDtype: return "dtype";
    case kQHeads: return "query heads";
    case kKvHeads: return "kv heads";
    case kHeadDim: return "head dim";
    case kCausal: return "causal";
    case kScale: return "softmax scale";
    case kBf16: return "bf16 dK/dV traffic";
  }
  return "?";
}

double scaleOf(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// A member's view from its digest row and its payload (documents then ranks).
std::string describe(const int64_t* row, const int64_t* payload, int global_rank) {
  std::ostringstream os;
  const int64_t nd = row[kDocCount], nr = row[kRingSize];
  os << "documents " << listOf(payload, nd) << " (sum " << row[kDocSum] << "), ring "
     << listOf(payload + nd, nr);
  const int64_t* r = payload + nd;
  const auto pos = std::find(r, r + nr, static_cast<int64_t>(global_rank)) - r;
  if (pos < nr) os << " (position " << pos << ")";
  os << ", dtype ";
  if (row[kDtype] >= 0 && row[kDtype] < static_cast<int64_t>(at::ScalarType::NumOptions))
    os << c10::toString(static_cast<at::ScalarType>(row[kDtype]));
  else
    os << "?";
  os << ", " << row[kQHeads] << " query / " << row[kKvHeads] << " kv heads, head dim "
     << row[kHeadDim] << ", " << (row[kCausal] ? "causal" : "not causal") << ", scale "
     << scaleOf(row[kScale]) << ", dK/dV traffic " << (row[kBf16] ? "bf16" : "full precision");
  return os.str();
}

at::TensorOptions optionsFor(const comm::Transport& tr, at::ScalarType dt) {
  auto o = at::TensorOptions().dtype(dt);
  return tr.deviceType() == c10::DeviceType::CPU ? o : o.device(tr.deviceType());
}

// A CPU tensor moved to the transport's device (the current one of its type).
at::Tensor onTransport(const at::Tensor& t, const comm::Transport& tr) {
  return tr.deviceType() == c10::DeviceType::CPU ? t : t.to(at::Device(tr.deviceType()));
}

// Members `senders` (group indices, distinct) send their payload to every other member; returns
// each sender's payload (CPU) as received (or this member's own). sizes[j]: member j's length.
std::vector<at::Tensor> shareFrom(comm::Transport& tr, const comm::RankMap& g,
                                  const std::vector<int>& senders, const at::Tensor& mine,
                                  const std::vector<int64_t>& sizes, at::ScalarType dt,
                                  const std::string& what) {
  const int n = g.size(), me = g.myIndex();
  std::vector<at::Tensor> got(senders.size());
  std::vector<comm::P2POp> ops;
  for (size_t s = 0; s < senders.size(); ++s) {
    const int j = senders[s];
    if (j == me) {
      got[s] = mine;
      for (int k = 0; k < n; ++k)
        if (k != me) ops.push_back({comm::P2POp::kSend, g.globalRank(k), mine});
    } else {
      got[s] = at::empty({sizes[j]}, optionsFor(tr, dt));
      ops.push_back({comm::P2POp::kRecv, g.globalRank(j), got[s]});
    }
  }
  tr.exchange(ops, what)->wait();
  for (auto& t : got) t = t.cpu();
  return got;
}

at::Tensor payloadOf(const RingView& v) {
  std::vector<int64_t> p(v.doc_lens);
  p.insert(p.end(), v.ranks.begin(), v.ranks.end());
  return at::tensor(p, at::TensorOptions().dtype(at::kLong));
}

}  // namespace

namespace {

struct Scope {
  std::mutex mu;
  uint64_t id = 0;  // 0: no scope
  uint64_t counter = 0;
  std::vector<std::vector<int64_t>> agreed;  // digests (status cleared) agreed in the scope
};

Scope& scope() {
  static auto* s = new Scope();  // never destroyed (used from any thread until exit)
  return *s;
}

std::atomic<int64_t>& exchanges() {
  static std::atomic<int64_t> n{0};
  return n;
}

}  // namespace

int64_t ringAgreementExchanges() { return exchanges().load(); }

uint64_t enterAgreementScope() {
  Scope& s = scope();
  std::lock_guard<std::mutex> g(s.mu);
  const uint64_t prev = s.id;
  s.id = ++s.counter;
  s.agreed.clear();
  return prev;
}

void exitAgreementScope(uint64_t previous) {
  Scope& s = scope();
  std::lock_guard<std::mutex> g(s.mu);
  s.id = previous;  // the outer scope restarts empty: at worst a call is checked again
  s.agreed.clear();
}

bool agreedInScope(const RingView& v, bool remember) {
  at::Tensor d = ringDigest(v);
  const int64_t* p = d.data_ptr<int64_t>();
  std::vector<int64_t> key(p, p + kDigestLen);
  key[kStatus] = 0;
  key.insert(key.end(), v.ranks.begin(), v.ranks.end());  // exact ring, not only its hash
  Scope& s = scope();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.id == 0) return false;
  if (std::find(s.agreed.begin(), s.agreed.end(), key) != s.agreed.end()) return true;
  if (remember) s.agreed.push_back(std::move(key));
  return false;
}

bool ringChecksEnabled() { return flag().load(std::memory_order_relaxed); }
void setRingChecksEnabled(bool on) { flag().store(on); }

at::Tensor ringDigest(const RingView& v) {
  at::Tensor d = at::empty({kDigestLen}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = d.data_ptr<int64_t>();
  int64_t sum = 0;
  for (auto x : v.doc_lens) sum += x;
  int64_t scale_bits;
  std::memcpy(&scale_bits, &v.scale, sizeof scale_bits);
  p[kTag] = kTagValue;
  p[kStatus] = static_cast<int64_t>(std::min(v.error.size(), kMaxErrorBytes));
  if (!v.error.empty() && p[kStatus] == 0) p[kStatus] = 1;
  p[kDocCount] = static_cast<int64_t>(v.doc_lens.size());
  p[kDocSum] = sum;
  p[kDocHash] = hashOf(v.doc_lens);
  p[kRingSize] = static_cast<int64_t>(v.ranks.size());
  p[kRingHash] = hashOf(v.ranks);
  p[kDtype] = v.dtype;
  p[kQHeads] = v.q_heads;
  p[kKvHeads] = v.kv_heads;
  p[kHeadDim] = v.head_dim;
  p[kCausal] = v.causal;
  p[kScale] = scale_bits;
  p[kBf16] = v.bf16_grad_comm;
  return d;
}

void checkRingAgreement(comm::Transport& tr, const comm::RankMap& group, const RingView& mine,
                        const std::string& what) {
  if (group.size() == 1) {
    TORCH_CHECK(mine.error.empty(), mine.error);
    return;
  }
  // The members sorted by global rank: the same map on every member that agrees on the set.
  std::vector<int> members = group.ranks();
  std::sort(members.begin(), members.end());
  const int me_global = group.globalRank(group.myIndex());
  const comm::RankMap g(members, group.worldSize(), me_global);
  const int n = g.size();
  const std::string tag = what + " (ring agreement check)";

  exchanges().fetch_add(1, std::memory_order_relaxed);
  at::Tensor digest = ringDigest(mine);
  const int64_t* d = digest.data_ptr<int64_t>();
  // Phase 1: the agreement primitive (comm/agreement.h) over `tr` (the host channel: a CUDA ring's
  // check needs no device synchronisation and never waits behind the NCCL stream).
  auto agreed = comm::agree(tr, g, comm::AgreementKind::kRingAttention,
                            std::vector<int64_t>(d, d + kDigestLen), tag);
  std::vector<int64_t> flat;
  for (const auto& r : agreed) flat.insert(flat.end(), r.begin(), r.begin() + kDigestLen);
  const int64_t* rows = flat.data();
  auto row = [&](int j) { return rows + static_cast<int64_t>(j) * kDigestLen; };

  // A member whose own inputs were invalid: it tells the others why, every member raises.
  for (int j = 0; j < n; ++j) {
    if (row(j)[kStatus] == 0) continue;
    std::string text = mine.error.substr(0, kMaxErrorBytes);
    if (text.empty()) text = " ";  // keep the advertised length (>= 1)
    at::Tensor bytes = at::from_blob(text.data(), {static_cast<int64_t>(text.size())},
                                     at::TensorOptions().dtype(at::kByte)).clone();
    std::vector<int64_t> sizes(n);
    for (int k = 0; k < n; ++k) sizes[k] = row(k)[kStatus];
    auto got = shareFrom(tr, g, {j}, onTransport(bytes, tr), sizes, at::kByte, tag)[0];
    TORCH_CHECK(mine.error.empty(), mine.error);
    std::string msg(reinterpret_cast<const char*>(got.data_ptr<uint8_t>()), got.numel());
    TORCH_CHECK(false, "bytescale ", what, ": rank ", g.globalRank(j),
                " rejected its inputs, so no K/V moved: ", msg);
  }

  int bad = -1;
  std::vector<const char*> fields;
  for (int j = 1; j < n && bad < 0; ++j)
    for (int f = 0; f < kDigestLen; ++f)
      if (f != kStatus && row(j)[f] != row(0)[f]) {
        bad = j;
        const char* name = fieldName(f);
        if (std::find(fields.begin(), fields.end(), name) == fields.end()) fields.push_back(name);
      }
  if (bad < 0) return;

  // Phase 2: the two members named send their documents and ranks so the message shows both.
  std::vector<int64_t> sizes(n);
  for (int k = 0; k < n; ++k) sizes[k] = row(k)[kDocCount] + row(k)[kRingSize];
  auto views = shareFrom(tr, g, {0, bad}, onTransport(payloadOf(mine), tr), sizes, at::kLong, tag);
  std::string differs;
  for (size_t i = 0; i < fields.size(); ++i) differs += (i ? ", " : "") + std::string(fields[i]);
  TORCH_CHECK(false, "bytescale ", what, ": the ring's members disagree (checked before any K/V "
              "moved; they differ in ", differs, "): rank ", g.globalRank(bad), " has ",
              describe(row(bad), views[1].data_ptr<int64_t>(), g.globalRank(bad)), ", but rank ",
              g.globalRank(0), " has ",
              describe(row(0), views[0].data_ptr<int64_t>(), g.globalRank(0)),
              ". Every member must pass the same documents, ring, dtype, head shapes, causal, "
              "scale and bf16_grad_comm (BYTESCALE_CHECK_RING=0 turns this check off)");
}

}  // namespace attention
}  // namespace bytescale
