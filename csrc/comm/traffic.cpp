// Per-process traffic counters (traffic.h).
#include "comm/traffic.h"

#include <mutex>
#include <set>
#include <utility>

namespace bytescale {
namespace comm {

namespace {

constexpr int kRows = static_cast<int>(Traffic::kCount);

struct Counters {
  std::array<std::atomic<int64_t>, kRows> sent{}, recv{}, ops{};
  std::atomic<int64_t> wait_ns{0};
};

Counters& counters() {
  static Counters c;
  return c;
}

thread_local Traffic current_scope = Traffic::kOther;

struct Peers {
  std::mutex mu;
  std::set<std::pair<const void*, int>> seen;
  std::atomic<int64_t> count{0};
};

Peers& peers() {
  static Peers p;
  return p;
}

int64_t take(std::atomic<int64_t>& a, bool reset) {
  return reset ? a.exchange(0, std::memory_order_relaxed) : a.load(std::memory_order_relaxed);
}

}  // namespace

const char* trafficName(Traffic t) {
  switch (t) {
    case Traffic::kRingKvFwd: return "ring_kv_fwd";
    case Traffic::kRingKvBwd: return "ring_kv_bwd";
    case Traffic::kRingDkvBwd: return "ring_dkv_bwd";
    case Traffic::kGradSync: return "grad_sync";
    default: return "other";
  }
}

void countTraffic(Traffic t, int64_t sent_bytes, int64_t recv_bytes) {
  const int i = static_cast<int>(t);
  if (i < 0 || i >= kRows) return;
  auto& c = counters();
  c.sent[i].fetch_add(sent_bytes, std::memory_order_relaxed);
  c.recv[i].fetch_add(recv_bytes, std::memory_order_relaxed);
  c.ops[i].fetch_add(1, std::memory_order_relaxed);
}

void countRingWait(int64_t ns) { counters().wait_ns.fetch_add(ns, std::memory_order_relaxed); }

TrafficSnapshot trafficSnapshot(bool reset) {
  auto& c = counters();
  TrafficSnapshot s;
  for (int i = 0; i < kRows; ++i) {
    s.rows[i].sent_bytes = take(c.sent[i], reset);
    s.rows[i].recv_bytes = take(c.recv[i], reset);
    s.rows[i].ops = take(c.ops[i], reset);
  }
  s.ring_wait_ns = take(c.wait_ns, reset);
  s.peers = trafficPeers();
  return s;
}

void countPeer(const void* transport, int peer) {
  auto& p = peers();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.seen.emplace(transport, peer).second) p.count.fetch_add(1, std::memory_order_relaxed);
}

int64_t trafficPeers() { return peers().count.load(std::memory_order_relaxed); }

void resetTrafficPeers() {
  auto& p = peers();
  std::lock_guard<std::mutex> lock(p.mu);
  p.seen.clear();
  p.count.store(0, std::memory_order_relaxed);
}

Traffic setTrafficScope(Traffic t) {
  const Traffic prev = current_scope;
  current_scope = t;
  return prev;
}

TrafficScope::TrafficScope(Traffic t) : saved_(setTrafficScope(t)) {}
TrafficScope::~TrafficScope() { current_scope = saved_; }
Traffic TrafficScope::current() { return current_scope; }

}  // namespace comm
}  // namespace bytescale
