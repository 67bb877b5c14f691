// GoogleTest: the HDP planner's invariants, Eq. 3 solver, serialisation and errors.
#include <gtest/gtest.h>

#include <random>

#include "planner/planner.h"

using namespace bytescale::planner;

namespace {
std::vector<int64_t> randomLengths(std::mt19937_64& rng, int n, int64_t cap, int64_t longest) {
  std::vector<int64_t> v;
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < n; ++i) {
    double x = u(rng);
    v.push_back(x < 0.9 ? 1 + static_cast<int64_t>(u(rng) * cap) : 1 + static_cast<int64_t>(u(rng) * longest));
  }
  return v;
}
}  // namespace

TEST(Planner, InvariantsHoldForAllStrategies) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    PlanOptions o;
    o.world_size = 1 + static_cast<int>(rng() % 13);
    o.capacity = 64 + static_cast<int64_t>(rng() % 200);
    o.offload = trial % 2;
    o.cost.layers = 4 + trial % 5;
    o.strategy = static_cast<Strategy>(trial % 3);
    if (trial % 4 == 3) {
      for (int r = 0; r < o.world_size; ++r) {
        o.speed.push_back(0.5 + (r % 3) * 0.5);
        o.memory.push_back(r % 2 ? 1.0 : 1.5);
      }
    }
    auto lens = randomLengths(rng, static_cast<int>(rng() % 40), o.capacity, o.capacity * o.world_size / 2 + 1);
    Plan p = makePlan(lens, o);
    ASSERT_NO_THROW(p.verify(lens, o)) << "trial " << trial;
    EXPECT_GE(p.makespan + 1e-12, p.lower_bound * (1 - 1e-9)) << "trial " << trial << " W=" << o.world_size << " strat=" << (int)o.strategy << " off=" << o.offload << " n=" << lens.size() << " hetero=" << !o.speed.empty();
  }
}

TEST(Planner, DeterministicAndSerialisable) {
  std::mt19937_64 rng(3);
  auto lens = randomLengths(rng, 200, 512, 4000);
  PlanOptions o;
  o.world_size = 11;
  o.capacity = 512;
  Plan a = makePlan(lens, o), b = makePlan(lens, o);
  EXPECT_EQ(a.serialize(), b.serialize());
  Plan c = Plan::deserialize(a.serialize().data(), a.serialize().size());
  EXPECT_EQ(c.serialize(), a.serialize());
  ASSERT_NO_THROW(c.verify(lens, o));
  auto bytes = a.serialize();
  EXPECT_THROW(Plan::deserialize(bytes.data(), bytes.size() - 3), std::invalid_argument);
  bytes[0] = 'X';
  EXPECT_THROW(Plan::deserialize(bytes.data(), bytes.size()), std::invalid_argument);
}

TEST(Planner, AnyGroupSizeNotPowerOfTwo) {
  PlanOptions o;
  o.world_size = 64;
  o.capacity = 8000;
  o.strategy = Strategy::kNaive;
  Plan p = makePlan({312000}, o);  // the paper's example: 39 ranks
  EXPECT_EQ(p.ring_grp[1] - p.ring_grp[0], 39);
  o.strategy = Strategy::kPow2;
  Plan q = makePlan({312000}, o);
  EXPECT_EQ(q.ring_grp[1] - q.ring_grp[0], 64);
}

TEST(Planner, Errors) {
  PlanOptions o;
  o.world_size = 4;
  o.capacity = 100;
  EXPECT_THROW(makePlan({500}, o), std::invalid_argument);   // needs 5 ranks
  EXPECT_THROW(makePlan({10, 0}, o), std::invalid_argument); // zero length
  EXPECT_THROW(makePlan({-3}, o), std::invalid_argument);
  o.speed = {1, 1};
  EXPECT_THROW(makePlan({10}, o), std::invalid_argument);    // wrong speed vector
  o.speed.clear();
  o.capacity = 0;
  EXPECT_THROW(makePlan({10}, o), std::invalid_argument);
  EXPECT_THROW(parseStrategy("fastest"), std::invalid_argument);
}

TEST(Planner, EmptyBatchAndWorldOne) {
  PlanOptions o;
  o.world_size = 3;
  o.capacity = 10;
  Plan p = makePlan({}, o);
  EXPECT_EQ(p.numMicroBatches(), 0);
  EXPECT_DOUBLE_EQ(p.imbalance, 1.0);
  o.world_size = 1;
  Plan q = makePlan({3, 4, 9, 2}, o);
  ASSERT_NO_THROW(q.verify({3, 4, 9, 2}, o));
  EXPECT_EQ(q.rank_mb[1], 2);  // 9+?; 4+3+2 -> two bins of 10
}

TEST(Planner, BalancedBeatsNaiveOnSkewedBatch) {
  // A few long sequences and many short ones: naive balances tokens, not quadratic time.
  std::vector<int64_t> lens;
  for (int i = 0; i < 6; ++i) lens.push_back(60000);
  for (int i = 0; i < 3000; ++i) lens.push_back(200 + (i * 37) % 3000);
  PlanOptions o;
  o.world_size = 32;
  o.capacity = 16384;
  o.strategy = Strategy::kNaive;
  Plan naive = makePlan(lens, o);
  o.strategy = Strategy::kBalanced;
  Plan bal = makePlan(lens, o);
  ASSERT_NO_THROW(bal.verify(lens, o));
  EXPECT_LT(bal.makespan, naive.makespan);
  EXPECT_LT(bal.imbalance, 1.1);
}

TEST(OffloadSolver, MatchesDirectSearch) {
  for (int layers : {3, 8, 32}) {
    for (double bw : {1e9, 1e10, 1e12}) {
      CostModel m;
      m.layers = layers;
      m.bw_d2h = m.bw_h2d = bw;
      for (int64_t s : {1000, 8192, 20000, 65536, 300000}) {
        const int64_t cap = 8192;
        OffloadChoice c = solveOffload(m, s, cap);
        // direct search over r on a fine grid
        const double act_s = m.act(s), act_c = m.act(cap);
        const double r_max = std::min(1.0, m.layerTime(s) * bw / act_s);
        int best = 1 << 30;
        for (int k = 0; k <= 20000; ++k) {
          double r = r_max * k / 20000.0;
          int d = static_cast<int>(std::ceil((2 + (1 - r) * (layers - 2)) * act_s / (layers * act_c) - 1e-12));
          best = std::min(best, std::max(1, d));
        }
        best = std::min(best, ranksWithoutOffload(m, s, cap));
        EXPECT_EQ(c.ranks, best) << "s=" << s << " l=" << layers << " bw=" << bw;
        EXPECT_GE(c.ratio, 0.0);
        EXPECT_LE(c.ratio, r_max + 1e-12);
        if (c.ranks == ranksWithoutOffload(m, s, cap)) EXPECT_EQ(c.ratio, 0.0);
      }
    }
  }
}

TEST(CostModel, JsonRoundTripAndErrors) {
  CostModel m;
  m.a1 = 1e-10;
  m.layers = 7;
  CostModel n = CostModel::fromJson(m.toJson());
  EXPECT_DOUBLE_EQ(n.a1, 1e-10);
  EXPECT_EQ(n.layers, 7);
  CostModel p = CostModel::fromJson(R"({"a1": 2e-11, "b1": 1e-6, "g": 0, "a2": 1000, "b2": 0,
      "layers": 4, "bw_d2h": 2e10, "bw_h2d": 2e10, "device": "cpu", "measured_at": "x"})");
  EXPECT_DOUBLE_EQ(p.a2, 1000);
  EXPECT_THROW(CostModel::fromJson(R"({"a2": -1})"), std::invalid_argument);
  EXPECT_THROW(CostModel::fromJson(R"({"a1": [1]})"), std::invalid_argument);
  EXPECT_THROW(CostModel::fromJson("not json"), std::invalid_argument);
}
