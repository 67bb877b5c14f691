// The planner's cost model (pure C++, no torch).
//
// Per layer, for a sequence of s tokens on one rank:
//   time        T(s)   = a1*s^2 + b1*s + g            (forward + backward, seconds)
//   activations Act(s) = a2*s + b2                    (bytes kept for backward)
// with `layers` layers per rank. Host<->device bandwidths bound how much can be offloaded under
// compute; ring bandwidth/latency price a sharded sequence's K/V traffic.
//
// Coefficients come from a JSON profile written by bytescale.profile() (keys a1, b1, g, a2, b2,
// layers, bw_d2h, bw_h2d, and optionally ring_bw, ring_latency). The defaults describe a
// LLaMA-7B-class layer on an H100 in bf16 (derived from FLOP counts, not measured):
//   linear part  ~ 6 * 200M params * s FLOP / 400 TFLOP/s  -> b1 = 3e-6 s/token
//   attention    ~ 6 * 4096 * s^2 FLOP (causal fwd+bwd)    -> a1 = 6.1e-11 s/token^2
//   activations  ~ 34 * hidden bytes per token (bf16)      -> a2 = 1.4e5 B/token
#pragma once

#include <cstdint>
#include <string>

namespace bytescale {
namespace planner {

struct CostModel {
  double a1 = 6.1e-11;
  double b1 = 3.0e-6;
  double g = 1.0e-4;
  double a2 = 1.4e5;
  double b2 = 0.0;
  int layers = 32;
  double bw_d2h = 50e9;   // bytes/s
  double bw_h2d = 50e9;   // bytes/s
  double ring_bw = 50e9;  // bytes/s per ring link
  double ring_latency = 10e-6;  // s per ring step
  double kv_bytes_per_token = 2 * 8 * 128 * 2;  // K and V, 8 kv heads x 128 dims, bf16

  double layerTime(double s) const { return a1 * s * s + b1 * s + g; }
  double act(double s) const { return a2 * s + b2; }

  // Whole-model compute time of a sequence of s tokens on one rank.
  double seqTime(double s) const { return layers * layerTime(s); }

  // Per-rank time of a sequence of s tokens sharded (zig-zag) over d ranks: an even share of the
  // compute, plus the ring's exposed communication: 2(d-1) exchanges of a K/V shard per layer
  // (forward and backward) that compute cannot hide.
  double shardedTime(double s, int d) const;

  // Validates ranges; throws std::invalid_argument naming the bad field.
  void validate() const;

  // Parse the JSON profile format (a flat object of numbers; other keys are ignored).
  static CostModel fromJson(const std::string& text);
  std::string toJson() const;
};

// Result of the offload-ratio solver (paper Eq. 3) for one sequence.
struct OffloadChoice {
  int ranks;     // D(s): ranks the sequence is sharded over
  double ratio;  // r: share of each layer's activations offloaded (0 = none)
};

// Ranks needed by a sequence of s tokens at per-rank capacity `capacity` tokens without
// offloading: ceil(Act(s) / Act(capacity)) (= ceil(s / capacity) when b2 = 0), at least 1.
int ranksWithoutOffload(const CostModel& m, int64_t s, int64_t capacity);

// Paper Eq. 3: minimise D(s) = ceil((2*Act(s) + (1-r)*(l-2)*Act(s)) / (l*Act(C))) over r in
// [0, r_max], where offloading r of a layer's activations must hide under that layer's compute:
// T(s) >= Act(s) * r / min(B_d2h, B_h2d), i.e. r_max = min(1, T(s) * min(B) / Act(s)) (sharding
// over D ranks divides both sides by D). Among the r giving the minimal D, returns the smallest
// (least PCIe traffic). With l <= 2 offloading cannot help (two layers' activations stay resident
// in any case) and r = 0. `hide` scales the compute the copies hide under: 1 is the paper's
// T(s) >= Act(s) r / B; kForwardShare asks each direction to hide under its own pass (the copy
// out beside the forward, about a third of a layer's forward + backward time; the copy back
// beside the backward), what the planner's default rule uses (offload_rule.h).
constexpr double kForwardShare = 1.0 / 3.0;
OffloadChoice solveOffload(const CostModel& m, int64_t s, int64_t capacity, double hide = 1.0);

}  // namespace planner
}  // namespace bytescale
