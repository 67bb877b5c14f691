// GoogleTest: the static DP x CP baseline as a planner strategy (csrc/planner/static_cp.cpp):
// its assignment against an independent reference (linear first-fit decreasing, round-robin
// replicas), the plan invariants, odd world sizes, empty ranks, lockstep slots, serialisation of
// packed ring micro-batches, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "planner/planner.h"
#include "planner/replay.h"

using namespace bytescale::planner;

namespace {

// What a rank runs, read back from a plan: per micro-batch, its sequences and its ring group.
struct Mb {
  std::vector<int64_t> seqs;
  std::vector<int32_t> ring;  // empty: local
  bool operator==(const Mb& o) const { return seqs == o.seqs && ring == o.ring; }
};

std::vector<std::vector<Mb>> readPlan(const Plan& p) {
  std::vector<std::vector<Mb>> out(p.world_size);
  for (int r = 0; r < p.world_size; ++r)
    for (int64_t m = p.rank_mb[r]; m < p.rank_mb[r + 1]; ++m) {
      Mb mb;
      for (int64_t k = p.mb_seg[m]; k < p.mb_seg[m + 1]; ++k) mb.seqs.push_back(p.seg_seq[k]);
      if (p.mb_ring[m] >= 0)
        mb.ring.assign(p.grp_ranks.begin() + p.ring_grp[p.mb_ring[m]],
                       p.grp_ranks.begin() + p.ring_grp[p.mb_ring[m] + 1]);
      out[r].push_back(mb);
    }
  return out;
}

// The baseline written independently (what bytescale/data/baselines.py did in Python): a linear
// first-fit scan, bins dealt round-robin.
std::vector<std::vector<Mb>> reference(const std::vector<int64_t>& len, int W, int64_t cap, int cp) {
  std::vector<int64_t> order(len.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> load;
  for (int64_t i : order) {
    size_t b = 0;
    while (b < bins.size() && load[b] + len[i] > cp * cap) ++b;
    if (b == bins.size()) {
      bins.emplace_back();
      load.push_back(0);
    }
    bins[b].push_back(i);
    load[b] += len[i];
  }
  const int R = W / cp;
  std::vector<std::vector<Mb>> out(W);
  for (size_t b = 0; b < bins.size(); ++b) {
    const int q = static_cast<int>(b % R);
    Mb mb{bins[b], {}};
    if (cp > 1)
      for (int k = 0; k < cp; ++k) mb.ring.push_back(q * cp + k);
    for (int k = 0; k < cp; ++k) out[q * cp + k].push_back(mb);
  }
  return out;
}

PlanOptions staticOptions(int W, int64_t cap, int cp = 0) {
  PlanOptions o;
  o.world_size = W;
  o.capacity = cap;
  o.strategy = Strategy::kStatic;
  o.static_cp = cp;
  o.cost.layers = 4;
  return o;
}

std::string errorOf(const std::vector<int64_t>& lens, const PlanOptions& o) {
  try {
    makePlan(lens, o);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(StaticPlanner, DegreeIsTheSmallestPowerOfTwoHoldingTheLongest) {
  EXPECT_EQ(staticCpDegree(0, 100, 1), 1);
  EXPECT_EQ(staticCpDegree(100, 100, 1), 1);
  EXPECT_EQ(staticCpDegree(101, 100, 2), 2);
  EXPECT_EQ(staticCpDegree(300, 100, 5), 4);
  EXPECT_EQ(staticCpDegree(400, 100, 4), 4);
  EXPECT_THROW(staticCpDegree(401, 100, 7), std::invalid_argument);  // needs 8 > 7
  EXPECT_THROW(staticCpDegree(10, 0, 4), std::invalid_argument);
}

TEST(StaticPlanner, MatchesTheReferenceAssignmentOnOddWorlds) {
  std::mt19937_64 rng(11);
  // (world, cp): odd worlds, cp = world, cp = 1, non-power-of-two cp that divides the world
  const std::vector<std::pair<int, int>> meshes = {{1, 1}, {2, 2}, {3, 1}, {3, 3}, {5, 1}, {5, 5},
                                                   {6, 2}, {6, 3}, {7, 7}, {9, 3}, {12, 4}, {16, 8}};
  for (int trial = 0; trial < 240; ++trial) {
    const auto [W, cp] = meshes[(trial / 2) % meshes.size()];
    const int64_t cap = 17 + static_cast<int64_t>(rng() % 200);  // divisible by nothing in particular
    std::vector<int64_t> lens(rng() % 60);
    for (auto& x : lens) x = 1 + static_cast<int64_t>(rng() % (trial % 3 == 0 ? cp * cap : cap));
    PlanOptions o = staticOptions(W, cap, trial % 2 ? cp : 0);
    o.peer_budget = 0;  // the reference lists a replica's ranks ascending (no peer-budget order)
    if (trial % 2 == 0) {  // the degree sized for the longest: take the mesh only when it is that
      const int64_t longest = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
      int auto_cp = 1;
      while (auto_cp * cap < longest) auto_cp *= 2;
      if (auto_cp > W || W % auto_cp) {
        EXPECT_THROW(makePlan(lens, o), std::invalid_argument) << "trial " << trial;
        continue;
      }
      o.static_cp = 0;
      Plan p = makePlan(lens, o);
      ASSERT_NO_THROW(p.verify(lens, o)) << "trial " << trial;
      EXPECT_EQ(readPlan(p), reference(lens, W, cap, auto_cp)) << "trial " << trial;
      continue;
    }
    Plan p = makePlan(lens, o);
    ASSERT_NO_THROW(p.verify(lens, o)) << "trial " << trial;
    EXPECT_EQ(p.strategy, "static");
    EXPECT_EQ(readPlan(p), reference(lens, W, cap, cp)) << "trial " << trial << " W=" << W << " cp=" << cp;
    EXPECT_GE(p.makespan + 1e-12, p.lower_bound * (1 - 1e-9)) << "trial " << trial;
    for (double x : p.mb_offload) EXPECT_EQ(x, 0.0);
    for (int32_t d : p.seg_ring_size) EXPECT_EQ(d, cp);  // EVERY sequence sharded over the CP group
  }
}

TEST(StaticPlanner, PacksSeveralSequencesIntoOneRingMicroBatch) {
  // cap 100, cp 2 (longest 150): bins of 200 tokens, first fit longest first: [150, 50]
  // [120, 80] [90, 60] (sequences 1 0, 3 4, 5 2), 3 replicas
  // of W = 6 -> one bin each on ranks {0,1}, {2,3}, {4,5}
  std::vector<int64_t> lens = {50, 150, 60, 120, 80, 90};
  PlanOptions o = staticOptions(6, 100);
  Plan p = makePlan(lens, o);
  ASSERT_NO_THROW(p.verify(lens, o));
  auto got = readPlan(p);
  EXPECT_EQ(got[0], (std::vector<Mb>{Mb{{1, 0}, {0, 1}}}));
  EXPECT_EQ(got[1], (std::vector<Mb>{Mb{{1, 0}, {0, 1}}}));
  EXPECT_EQ(got[2], (std::vector<Mb>{Mb{{3, 4}, {2, 3}}}));
  EXPECT_EQ(got[5], (std::vector<Mb>{Mb{{5, 2}, {4, 5}}}));
  EXPECT_EQ(p.numRings(), 3);
  // the micro-batch's cost: each sequence's sharded time at cp 2
  EXPECT_NEAR(p.mb_cost[0], o.cost.shardedTime(150, 2) + o.cost.shardedTime(50, 2), 1e-15);
  // a packed ring micro-batch survives serialisation and its structure check
  auto bytes = p.serialize();
  Plan q = Plan::deserialize(bytes.data(), bytes.size());
  EXPECT_EQ(q.serialize(), bytes);
  ASSERT_NO_THROW(q.verify(lens, o));
  // a corrupted position inside a packed ring micro-batch is a structure error
  q.seg_ring_pos[1] = 1 - q.seg_ring_pos[1];
  auto bad = q.serialize();
  EXPECT_THROW(Plan::deserialize(bad.data(), bad.size()), std::invalid_argument);
}

TEST(StaticPlanner, EmptyRanksAndLockstepPadding) {
  // 3 sequences of one bin each on W = 10 at cp 2: replicas 3 and 4 (ranks 6..9) get nothing
  std::vector<int64_t> lens = {190, 180, 170};
  PlanOptions o = staticOptions(10, 100);
  Plan p = makePlan(lens, o);
  ASSERT_NO_THROW(p.verify(lens, o));
  for (int r = 0; r < 10; ++r) EXPECT_EQ(p.rank_mb[r + 1] - p.rank_mb[r], r < 6 ? 1 : 0) << r;
  LockstepSlots s = lockstepSlots(p);
  EXPECT_EQ(s.num_slots, 1);
  for (int r = 6; r < 10; ++r) EXPECT_EQ(s.at(r, 0), -1);
  // more bins than replicas on cp 1: replicas run ceil / floor of bins / replicas, padded
  o = staticOptions(3, 100);
  lens = {100, 100, 100, 100, 40, 40};  // bins [100] [100] [100] [100] [40 40] -> 2, 2, 1
  p = makePlan(lens, o);
  ASSERT_NO_THROW(p.verify(lens, o));
  EXPECT_EQ(p.numRings(), 0);
  s = lockstepSlots(p);
  ASSERT_EQ(s.num_slots, 2);
  for (int r = 0; r < 3; ++r)
    for (int64_t k = 0; k < 2; ++k)  // slot k = the rank's k-th micro-batch, padding after
      EXPECT_EQ(s.at(r, k), k < p.rank_mb[r + 1] - p.rank_mb[r] ? p.rank_mb[r] + k : -1);
  // an empty batch
  p = makePlan({}, staticOptions(4, 100, 2));
  ASSERT_NO_THROW(p.verify({}, staticOptions(4, 100, 2)));
  EXPECT_EQ(p.numMicroBatches(), 0);
}

TEST(StaticPlanner, MemoryMultipliersUseTheSmallestCapacity) {
  PlanOptions o = staticOptions(4, 100, 2);
  o.memory = {1.0, 0.5, 1.0, 1.0};  // the mesh holds 50 tokens per rank: bins of 100
  o.speed = {1.0, 1.0, 2.0, 1.0};
  std::vector<int64_t> lens = {100, 60, 40, 30};
  Plan p = makePlan(lens, o);
  ASSERT_NO_THROW(p.verify(lens, o));
  EXPECT_EQ(readPlan(p), reference(lens, 4, 50, 2));
  EXPECT_THROW(makePlan({101}, o), std::invalid_argument);
}

TEST(StaticPlanner, BadInputNamesTheValues) {
  const std::vector<int64_t> lens = {150, 40};
  std::string e = errorOf(lens, staticOptions(6, 100, 4));
  EXPECT_NE(e.find("static_cp = 4 does not divide world_size 6"), std::string::npos) << e;
  e = errorOf(lens, staticOptions(4, 100, 8));
  EXPECT_NE(e.find("static_cp = 8 is larger than world_size 4"), std::string::npos) << e;
  e = errorOf({350}, staticOptions(6, 100));  // sized for the longest: cp 4, which 6 is not a multiple of
  EXPECT_NE(e.find("CP degree 4 does not divide world size 6"), std::string::npos) << e;
  e = errorOf({450}, staticOptions(5, 100));  // needs 8 > 5 (and 5 ranks: it fits the world)
  EXPECT_NE(e.find("needs CP degree"), std::string::npos) << e;
  e = errorOf({250, 10}, staticOptions(4, 100, 2));  // fits the world, not a CP group of 2
  EXPECT_NE(e.find("sequence 0 of 250 tokens does not fit CP degree 2"), std::string::npos) << e;
  PlanOptions o = staticOptions(4, 100, -1);
  EXPECT_NE(errorOf(lens, o).find("static_cp must be >= 0"), std::string::npos);
  o = staticOptions(4, 100);
  o.offload = true;
  EXPECT_NE(errorOf(lens, o).find("does not offload"), std::string::npos);
  o = staticOptions(4, 100, 2);
  o.strategy = Strategy::kBalanced;
  EXPECT_NE(errorOf(lens, o).find("applies to strategy 'static' only"), std::string::npos);
  EXPECT_EQ(parseStrategy("static"), Strategy::kStatic);
  EXPECT_EQ(strategyName(Strategy::kStatic), "static");
}
