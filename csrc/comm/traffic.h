// Per-process traffic counters: what this rank's transports moved, by purpose (pure C++, no torch).
//
// Counted where the bytes are handed to the transport, so they are exact and do not depend on the
// machine's load: Transport::ringStep counts the bytes it sends and receives and one ring step,
// under the purpose of the calling thread's TrafficScope (ring attention sets one per phase); the
// collective front end counts each collective's payload (its input bytes sent, output bytes
// received) under the caller's scope (HybridDataParallel's gradient buckets: kGradSync) or kOther.
// Ring attention adds the time it blocks in a ring exchange's wait() (kRingWait; on CUDA wait() only
// orders streams, so that time is host time, near zero). Relaxed atomics: a few adds per exchange.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

namespace bytescale {
namespace comm {

enum class Traffic : int {
  kOther = 0,     // anything without a scope (agreement checks, metrics, loss reductions, ...)
  kRingKvFwd,     // ring attention forward: K/V blocks
  kRingKvBwd,     // ring attention backward: K/V blocks travelling again
  kRingDkvBwd,    // ring attention backward: dK/dV accumulators
  kGradSync,      // gradient all-reduce payload (HybridDataParallel's buckets)
  kCount
};

const char* trafficName(Traffic t);  // "other", "ring_kv_fwd", "ring_kv_bwd", "ring_dkv_bwd", "grad_sync"

struct TrafficSnapshot {
  struct Row {
    int64_t sent_bytes = 0, recv_bytes = 0, ops = 0;  // ops: ring steps or collectives
  };
  std::array<Row, static_cast<int>(Traffic::kCount)> rows{};
  int64_t ring_wait_ns = 0;  // time ring attention blocked waiting for its ring partners
  int64_t peers = 0;         // distinct point-to-point peers so far (countPeer; never reset here)
};

// Adds to the process's counters (thread-safe).
void countTraffic(Traffic t, int64_t sent_bytes, int64_t recv_bytes);
void countRingWait(int64_t ns);
// The counters now; with reset, they restart from zero (all but `peers`, see countPeer).
TrafficSnapshot trafficSnapshot(bool reset);

// Point-to-point peers: every send or receive of tensor data a transport is handed (ring steps,
// send / recv / isend / irecv, a dynamic group's ring step, the chunked ring broadcast of group
// collectives) records (transport, peer). The count of distinct pairs is what NCCL keeps
// point-to-point buffers for (per communicator and peer, never freed; NCCL issue #2294), so it
// is cumulative: trafficSnapshot(reset) leaves it, resetTrafficPeers() clears it. Not counted:
// the agreement primitive's digests and barrier tokens (on CUDA they run over the host channel).
void countPeer(const void* transport, int peer);
int64_t trafficPeers();
void resetTrafficPeers();

// Sets the purpose of the current thread's traffic; returns the previous one (Python's scope).
Traffic setTrafficScope(Traffic t);

// The purpose of the traffic the current thread issues while the scope lives (scopes nest).
class TrafficScope {
 public:
  explicit TrafficScope(Traffic t);
  ~TrafficScope();
  TrafficScope(const TrafficScope&) = delete;
  TrafficScope& operator=(const TrafficScope&) = delete;
  static Traffic current();

 private:
  Traffic saved_;
};

}  // namespace comm
}  // namespace bytescale
