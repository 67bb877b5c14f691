// GoogleTest: offloading under the step's clock (csrc/planner/offload_rule.h).
//   * property: for every HDP strategy, on random batches (uniform and heterogeneous ranks, odd
//     world sizes, heavy tails), the plan with offloading replays no longer than without it;
//   * the paper's literal Eq. 3 stays reachable (OffloadRule::kPaperEq3) and on a 2M-token-like
//     batch is the long ring the step rule avoids;
//   * explainRings names the constraint that set each ring's size.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>

#include "planner/offload_rule.h"
#include "planner/planner.h"

using namespace bytescale::planner;

namespace {

// Mostly short sequences plus a heavy tail up to `longest` (a few far above the capacity).
std::vector<int64_t> heavyTail(std::mt19937_64& rng, int n, int64_t cap, int64_t longest) {
  std::vector<int64_t> v;
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < n; ++i) {
    const double x = u(rng);
    if (x < 0.75) v.push_back(1 + static_cast<int64_t>(u(rng) * cap));
    else if (x < 0.95) v.push_back(1 + static_cast<int64_t>(u(rng) * 4 * cap));
    else v.push_back(1 + static_cast<int64_t>(std::pow(u(rng), 0.5) * longest));
  }
  return v;
}

const Strategy kHdp[] = {Strategy::kNaive, Strategy::kPow2, Strategy::kBalanced};

}  // namespace

TEST(OffloadStepClock, NeverReplaysLongerThanWithoutOffloading) {
  std::mt19937_64 rng(2025);
  int shrunk = 0, trials = 0;
  for (int trial = 0; trial < 240; ++trial) {
    PlanOptions o;
    o.world_size = 1 + static_cast<int>(rng() % 40);
    o.capacity = 64 + static_cast<int64_t>(rng() % 400);
    o.cost.layers = 3 + static_cast<int>(rng() % 30);
    // copies that hide easily, barely, or not at all; exposed and hidden ring communication
    o.cost.bw_d2h = o.cost.bw_h2d = std::array<double, 3>{50e9, 1e8, 1e6}[rng() % 3];
    o.cost.a1 = std::array<double, 3>{6.1e-11, 1e-9, 1e-12}[rng() % 3];
    o.cost.ring_bw = std::array<double, 2>{50e9, 1e9}[rng() % 2];
    if (trial % 5 == 4)
      for (int r = 0; r < o.world_size; ++r) {
        o.speed.push_back(0.5 + (r % 3) * 0.5);
        o.memory.push_back(r % 2 ? 1.0 : 1.5);
      }
    const int64_t longest = o.capacity * std::max(1, o.world_size) * (1 + static_cast<int64_t>(rng() % 2));
    auto lens = heavyTail(rng, 1 + static_cast<int>(rng() % 60), o.capacity, longest);
    for (Strategy s : kHdp) {
      o.strategy = s;
      o.offload = false;
      Plan without;
      try {
        without = makePlan(lens, o);
      } catch (const std::invalid_argument&) {
        continue;  // does not fit without offloading: no reference to compare with
      }
      o.offload = true;
      Plan with = makePlan(lens, o);
      ASSERT_NO_THROW(with.verify(lens, o)) << "trial " << trial << " " << strategyName(s);
      ++trials;
      EXPECT_LE(with.makespan, without.makespan * (1 + 1e-9))
          << "trial " << trial << " strategy " << strategyName(s) << " W=" << o.world_size
          << " cap=" << o.capacity << " n=" << lens.size();
      // a ring below its no-offload size exists somewhere (the rule does shrink rings)
      for (size_t k = 0; k < with.seg_seq.size(); ++k)
        if (with.seg_ring_size[k] < ranksWithoutOffload(o.cost, lens[with.seg_seq[k]], o.capacity) &&
            o.memory.empty()) {
          ++shrunk;
          break;
        }
    }
  }
  EXPECT_GT(trials, 400);
  EXPECT_GT(shrunk, 0) << "offloading never shrank a ring: the property above would be vacuous";
}

TEST(OffloadStepClock, PaperEq3IsReachableAndIsTheLongRing) {
  // LLaMA-7B-like defaults, one 2M-token sequence plus short ones, 1,024 ranks of 8K tokens.
  PlanOptions o;
  o.world_size = 1024;
  o.capacity = 8192;
  std::vector<int64_t> lens{2 << 20};
  std::mt19937_64 rng(1);
  int64_t total = lens[0];
  while (total < (32 << 20)) {
    const int64_t s = 512 + static_cast<int64_t>(rng() % 8000);
    lens.push_back(s);
    total += s;
  }
  for (Strategy s : {Strategy::kNaive, Strategy::kPow2}) {
    o.strategy = s;
    o.offload = false;
    const Plan base = makePlan(lens, o);
    o.offload = true;
    o.offload_rule = OffloadRule::kPaperEq3;
    const Plan eq3 = makePlan(lens, o);
    ASSERT_NO_THROW(eq3.verify(lens, o));
    o.offload_rule = OffloadRule::kStep;
    const Plan step = makePlan(lens, o);
    ASSERT_NO_THROW(step.verify(lens, o));
    // Eq. 3 literally: the 2M sequence on its minimum ring, far fewer than 256 ranks, and a step
    // several times longer than without offloading; the step rule never is.
    const auto eq3_why = explainRings(eq3, lens, o);
    EXPECT_LT(eq3_why[0].ranks, 64) << strategyName(s);
    EXPECT_GT(eq3.makespan, 2 * base.makespan) << strategyName(s);
    EXPECT_LE(step.makespan, base.makespan * (1 + 1e-9)) << strategyName(s);
    const auto why = explainRings(step, lens, o);
    EXPECT_GE(why[0].ranks, 128) << strategyName(s);
    EXPECT_EQ(why[0].reason, RingReason::kStep) << ringReasonName(why[0].reason);
    EXPECT_EQ(why[0].floor_memory, 256);
    EXPECT_LT(why[0].floor_offload, 256);
  }
  EXPECT_EQ(parseOffloadRule("paper-eq3"), OffloadRule::kPaperEq3);
  EXPECT_EQ(offloadRuleName(OffloadRule::kStep), "step");
  EXPECT_THROW(parseOffloadRule("eq3"), std::invalid_argument);
}

TEST(OffloadStepClock, ReasonsNameTheBindingConstraint) {
  PlanOptions o;
  o.world_size = 8;
  o.capacity = 1000;
  o.cost.layers = 10;
  o.offload = true;
  o.strategy = Strategy::kNaive;
  o.offload_rule = OffloadRule::kPaperEq3;
  // slowish copies: a 5,000-token sequence hides about half its activations' copies under its
  // compute, so copy hiding (not memory) stops the ring at 4 ranks (1 if everything could go)
  o.cost.bw_d2h = o.cost.bw_h2d = 2e10;
  std::vector<int64_t> lens{5000, 300, 200};
  Plan p = makePlan(lens, o);
  auto why = explainRings(p, lens, o);
  ASSERT_EQ(why.size(), 3u);
  EXPECT_EQ(why[1].reason, RingReason::kLocal);
  EXPECT_EQ(why[2].reason, RingReason::kLocal);
  EXPECT_EQ(why[0].floor_memory, 5);
  const OffloadChoice c = solveOffload(o.cost, 5000, 1000);
  EXPECT_EQ(why[0].ranks, c.ranks);
  EXPECT_EQ(why[0].floor_offload, c.ranks);
  EXPECT_GT(c.ranks, 1);
  EXPECT_LT(c.ranks, 5);
  EXPECT_GT(why[0].ratio, 0.0);
  EXPECT_EQ(why[0].reason, RingReason::kCopyHiding);
  // fast copies: everything offloadable hides, only the two resident layers bound the ring
  o.cost.bw_d2h = o.cost.bw_h2d = 50e9;
  p = makePlan(lens, o);
  why = explainRings(p, lens, o);
  EXPECT_EQ(why[0].ranks, 1);  // ceil(2 * 5000 / (10 * 1000)) = 1
  EXPECT_GT(why[0].ratio, 0.0);
  EXPECT_EQ(why[0].reason, RingReason::kMemory);
  // without offloading the memory floor is D0
  o.offload = false;
  p = makePlan(lens, o);
  why = explainRings(p, lens, o);
  EXPECT_EQ(why[0].ranks, 5);
  EXPECT_EQ(why[0].ratio, 0.0);
  EXPECT_EQ(why[0].reason, RingReason::kMemory);
  // pow2 rounds 5 up to 8: the shape
  o.strategy = Strategy::kPow2;
  p = makePlan(lens, o);
  why = explainRings(p, lens, o);
  EXPECT_EQ(why[0].ranks, 8);
  EXPECT_EQ(why[0].reason, RingReason::kShape);
  // wrong inputs are named
  std::vector<int64_t> fewer{5000};
  EXPECT_THROW(explainRings(p, fewer, o), std::invalid_argument);
}
