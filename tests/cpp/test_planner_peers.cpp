// GoogleTest: the peer budget (PlanOptions::peer_budget). Budget 0 reproduces the unbounded planner
// byte for byte (digests of plans recorded before the budget existed); with a budget K, over many
// planned steps no rank has more than K distinct ring neighbours, for every ring-forming strategy.
#include <gtest/gtest.h>

#include "heavy_tail_batch.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "planner/peer_budget.h"
#include "planner/planner.h"

using namespace bytescale::planner;

namespace {

uint64_t fnv(const std::vector<uint8_t>& b) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t c : b) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

using bytescale_test::heavyTailBatch;  // lengths like the paper's corpora (heavy_tail_batch.h)

struct Case {
  Strategy strategy;
  int world;
  bool offload;
  int stages;
};

// The cases of the budget-0 digests: every strategy, small and mid-sized worlds, with and without
// offloading (static: without), pipelines for the pp-* strategies.
std::vector<Case> digestCases() {
  std::vector<Case> out;
  for (Strategy s : {Strategy::kNaive, Strategy::kBalanced, Strategy::kPow2, Strategy::kStatic,
                     Strategy::kPPBalance, Strategy::kPPLockstep})
    for (int w : {8, 32, 128})
      for (int off = 0; off < 2; ++off) {
        if (s == Strategy::kStatic && off) continue;
        const bool pp = s == Strategy::kPPBalance || s == Strategy::kPPLockstep;
        out.push_back({s, w, off != 0, pp ? 4 : 1});
      }
  return out;
}

PlanOptions optionsFor(const Case& c, int64_t cap) {
  PlanOptions o;
  o.world_size = c.world;
  o.capacity = cap;
  o.strategy = c.strategy;
  o.offload = c.offload;
  o.pipeline.stages = c.stages;
  return o;
}

}  // namespace

// The digests below were recorded from the planner before PlanOptions::peer_budget existed
// (BYTESCALE_PRINT_DIGESTS=1 prints them).
TEST(PeerBudget, ZeroReproducesTheUnboundedPlanner) {
  const uint64_t kExpected[] = {
      0x6df43bb33e33b689ull,  // naive W=8 offload=0 seed=0
      0xa398f4fcd8b205a5ull,  // naive W=8 offload=0 seed=1
      0xb05349398f316f94ull,  // naive W=8 offload=1 seed=0
      0xf5982ea55a00caf3ull,  // naive W=8 offload=1 seed=1
      0x3b4783727362d850ull,  // naive W=32 offload=0 seed=0
      0x1b3d02a32eda89e3ull,  // naive W=32 offload=0 seed=1
      0xa85a85b2c0355064ull,  // naive W=32 offload=1 seed=0
      0x3ebc46fe38ef721bull,  // naive W=32 offload=1 seed=1
      0x624f4988997af964ull,  // naive W=128 offload=0 seed=0
      0x3e2b1281d96da299ull,  // naive W=128 offload=0 seed=1
      0x2da5c1529e0c87e7ull,  // naive W=128 offload=1 seed=0
      0xe64657e847bc3b15ull,  // naive W=128 offload=1 seed=1
      0x6042d0aea1f10b65ull,  // balanced W=8 offload=0 seed=0
      0x07009f8a03d0674aull,  // balanced W=8 offload=0 seed=1
      0x6042d0aea1f10b65ull,  // balanced W=8 offload=1 seed=0
      0x07009f8a03d0674aull,  // balanced W=8 offload=1 seed=1
      0x69006f7ab6970f76ull,  // balanced W=32 offload=0 seed=0
      0x317bded8c80e8624ull,  // balanced W=32 offload=0 seed=1
      0x69006f7ab6970f76ull,  // balanced W=32 offload=1 seed=0
      0x317bded8c80e8624ull,  // balanced W=32 offload=1 seed=1
      0x2c9a4b4682b85844ull,  // balanced W=128 offload=0 seed=0
      0x53d844253ccddbaaull,  // balanced W=128 offload=0 seed=1
      0x2c9a4b4682b85844ull,  // balanced W=128 offload=1 seed=0
      0x53d844253ccddbaaull,  // balanced W=128 offload=1 seed=1
      0xe7930726bc461fb5ull,  // pow2 W=8 offload=0 seed=0
      0x032462b4d1d0c3f9ull,  // pow2 W=8 offload=0 seed=1
      0x51f6caa31f2bb8d8ull,  // pow2 W=8 offload=1 seed=0
      0x4cd55b1ec0d9747full,  // pow2 W=8 offload=1 seed=1
      0xf17aee3042478c9full,  // pow2 W=32 offload=0 seed=0
      0xc988157eb8286178ull,  // pow2 W=32 offload=0 seed=1
      0xac69913c034f574bull,  // pow2 W=32 offload=1 seed=0
      0xd98cd71e2c6a6a58ull,  // pow2 W=32 offload=1 seed=1
      0xd2a8010ca5675821ull,  // pow2 W=128 offload=0 seed=0
      0xa363f9bab90ff3f2ull,  // pow2 W=128 offload=0 seed=1
      0x4890845c37ddcea3ull,  // pow2 W=128 offload=1 seed=0
      0x0665c039ad985446ull,  // pow2 W=128 offload=1 seed=1
      0x23fd312a83eda4eeull,  // static W=8 offload=0 seed=0
      0x0cdde6d1ddf9e4d2ull,  // static W=8 offload=0 seed=1
      0x7da6f92f23f66cc4ull,  // static W=32 offload=0 seed=0
      0x22053caa2270b9e4ull,  // static W=32 offload=0 seed=1
      0x902c972492333c96ull,  // static W=128 offload=0 seed=0
      0x9034834204354601ull,  // static W=128 offload=0 seed=1
      0xa1840066a45d92ffull,  // pp-balance W=8 offload=0 seed=0
      0x283bc8c1dcdfbdbbull,  // pp-balance W=8 offload=0 seed=1
      0x344323f622742200ull,  // pp-balance W=8 offload=1 seed=0
      0x3f72752737e310d3ull,  // pp-balance W=8 offload=1 seed=1
      0x27648652afe0b5daull,  // pp-balance W=32 offload=0 seed=0
      0x2d8373524cfe1a84ull,  // pp-balance W=32 offload=0 seed=1
      0x7503b7720c93439full,  // pp-balance W=32 offload=1 seed=0
      0xacd485bc770343cdull,  // pp-balance W=32 offload=1 seed=1
      0xbf0f53e39addbc7eull,  // pp-balance W=128 offload=0 seed=0
      0xfe3c020e280a50b6ull,  // pp-balance W=128 offload=0 seed=1
      0xbbb663e9f584e5d6ull,  // pp-balance W=128 offload=1 seed=0
      0x754511efbecf4435ull,  // pp-balance W=128 offload=1 seed=1
      0x8a3dce7429cc779aull,  // pp-lockstep W=8 offload=0 seed=0
      0x4625346a38f62f1dull,  // pp-lockstep W=8 offload=0 seed=1
      0x7751f6a01671cb7aull,  // pp-lockstep W=8 offload=1 seed=0
      0x104b307d4216ff85ull,  // pp-lockstep W=8 offload=1 seed=1
      0x9c3a3e60938da231ull,  // pp-lockstep W=32 offload=0 seed=0
      0x8169a47cedc625e7ull,  // pp-lockstep W=32 offload=0 seed=1
      0x450d702917d0dafcull,  // pp-lockstep W=32 offload=1 seed=0
      0xe520e2677e4b81ffull,  // pp-lockstep W=32 offload=1 seed=1
      0xe733dacf8840a3aaull,  // pp-lockstep W=128 offload=0 seed=0
      0x49f37c732c71ce17ull,  // pp-lockstep W=128 offload=0 seed=1
      0x93afd66a5025a198ull,  // pp-lockstep W=128 offload=1 seed=0
      0x76f3dfb2fe258137ull,  // pp-lockstep W=128 offload=1 seed=1
  };
  const bool print = std::getenv("BYTESCALE_PRINT_DIGESTS") != nullptr;
  const std::vector<Case> cases = digestCases();
  size_t k = 0;
  for (const Case& c : cases)
    for (int seed = 0; seed < 2; ++seed) {
      std::mt19937_64 rng(1000 + 17 * c.world + seed);
      const int64_t cap = 4096;
      const auto lens = heavyTailBatch(rng, 3 * c.world, cap, 12 * cap);
      PlanOptions o = optionsFor(c, cap);
      o.peer_budget = 0;
      const uint64_t h = fnv(makePlan(lens, o).serialize());
      if (print) std::printf("      0x%016llxull,  // %s W=%d offload=%d seed=%d\n",
                             static_cast<unsigned long long>(h), strategyName(c.strategy).c_str(),
                             c.world, c.offload ? 1 : 0, seed);
      else {
        ASSERT_LT(k, sizeof(kExpected) / sizeof(kExpected[0]));
        EXPECT_EQ(h, kExpected[k]) << strategyName(c.strategy) << " W=" << c.world
                                   << " offload=" << c.offload << " seed=" << seed;
      }
      ++k;
    }
}

namespace {

// Distinct ring neighbours (prev and next of every ring a rank is in) per rank, over steps.
struct Neighbours {
  std::vector<std::set<int>> of;
  explicit Neighbours(int W) : of(W) {}
  void add(const Plan& p) {
    for (int64_t k = 0; k < p.numRings(); ++k) {
      const int64_t g0 = p.ring_grp[k], d = p.ring_grp[k + 1] - g0;
      if (d < 2) continue;
      for (int64_t j = 0; j < d; ++j) {
        const int a = p.grp_ranks[g0 + j], b = p.grp_ranks[g0 + (j + 1) % d];
        of[a].insert(b);
        of[b].insert(a);
      }
    }
  }
  size_t most() const {
    size_t m = 0;
    for (const auto& s : of) m = std::max(m, s.size());
    return m;
  }
};

// Plans `steps` batches of a byted-like mix (most sequences short, a heavy tail up to 32
// capacities; `fill` x W x cap tokens) at `W` ranks with each strategy of `strategies`, checks
// every plan and that no rank had more than 4 distinct ring neighbours (budget 4, the default).
// Odd steps offload. benchmarks/bench_peers.py runs the same over 10,000 steps.
void checkBound(int W, int steps, int64_t cap, double fill, const std::vector<Strategy>& strategies) {
  for (Strategy s : strategies) {
    const bool pp = s == Strategy::kPPBalance || s == Strategy::kPPLockstep;
    Neighbours nb(W);
    std::mt19937_64 rng(7 + W);
    int rings = 0;
    for (int step = 0; step < steps; ++step) {
      PlanOptions o;
      o.world_size = W;
      o.capacity = cap;
      o.strategy = s;
      o.offload = s != Strategy::kStatic && step % 2 == 1;
      o.pipeline.stages = pp ? 4 : 1;
      EXPECT_EQ(o.peer_budget, 4);
      std::vector<int64_t> lens;
      int64_t tokens = 0;
      std::uniform_real_distribution<double> u(0, 1);
      while (tokens < static_cast<int64_t>(fill * W * cap)) {
        const double x = u(rng);
        const double hi = x < 0.8 ? cap : x < 0.97 ? 4.0 * cap : 32.0 * cap;
        const int64_t l = std::max<int64_t>(1, static_cast<int64_t>(std::exp(u(rng) * std::log(hi))));
        lens.push_back(l);
        tokens += l;
      }
      if (s == Strategy::kStatic)  // one CP degree: a divisor of W
        o.static_cp = 32;
      const auto t0 = std::chrono::steady_clock::now();
      const Plan p = makePlan(lens, o);
      if (std::getenv("BYTESCALE_PEER_TIMES"))
        std::printf("%s W=%d n=%zu rings=%lld %.3f s\n", strategyName(s).c_str(), W, lens.size(),
                    static_cast<long long>(p.numRings()),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      ASSERT_NO_THROW(p.verify(lens, o)) << strategyName(s) << " W=" << W << " step " << step;
      rings += static_cast<int>(p.numRings());
      nb.add(p);
    }
    EXPECT_GT(rings, 0) << strategyName(s);
    EXPECT_LE(nb.most(), 4u) << strategyName(s) << " W=" << W << " after " << steps << " steps";
  }
}

}  // namespace

TEST(PeerBudget, NoRankExceedsFourNeighboursAt1024Ranks) {
  checkBound(1024, 6, 4096, 0.75, {Strategy::kBalanced, Strategy::kNaive, Strategy::kPow2,
                                   Strategy::kStatic, Strategy::kPPLockstep});
  checkBound(1024, 2, 4096, 0.5, {Strategy::kPPBalance});  // the slow search: fewer steps
}

TEST(PeerBudget, NoRankExceedsFourNeighboursAt16384Ranks) {
  // one step each, kept fast for the sanitized run (pp-balance plans 16,384 pipelines in ~20 s with
  // or without the budget: benchmarks/bench_peers.py covers it)
  checkBound(16384, 1, 4096, 0.25, {Strategy::kBalanced, Strategy::kNaive, Strategy::kPow2,
                                    Strategy::kStatic, Strategy::kPPLockstep});
}

TEST(PeerBudget, UnboundedPlansExceedTheBudget) {
  // The reason for the budget: the same batches planned without it give ranks more neighbours.
  Neighbours nb(1024);
  std::mt19937_64 rng(3);
  for (int step = 0; step < 12; ++step) {
    PlanOptions o;
    o.world_size = 1024;
    o.capacity = 4096;
    o.peer_budget = 0;
    nb.add(makePlan(heavyTailBatch(rng, 3000, 4096, 64 * 4096), o));
  }
  EXPECT_GT(nb.most(), 4u);
}

TEST(PeerBudget, RingOrderAndErrors) {
  PlanOptions o;
  o.world_size = 64;
  o.capacity = 100;
  for (int k : {-1, 1, 2, 3}) {
    o.peer_budget = k;
    EXPECT_THROW(makePlan({50, 900}, o), std::invalid_argument) << k;
  }
  o.peer_budget = 4;
  // one ring of 7 or more ranks: members a, a+2, a+4, ..., a+3, a+1
  const Plan p = makePlan({650}, o);
  ASSERT_EQ(p.numRings(), 1);
  const std::vector<int32_t> ring(p.grp_ranks.begin(), p.grp_ranks.end());
  ASSERT_GE(ring.size(), 7u);
  const int a = ring[0], d = static_cast<int>(ring.size());
  std::vector<int32_t> expect;  // a, a+2, ..., then the other parity descending, ..., a+1
  for (int k = 0; k < d; k += 2) expect.push_back(a + k);
  for (int k = d % 2 ? d - 2 : d - 1; k >= 1; k -= 2) expect.push_back(a + k);
  EXPECT_EQ(ring, expect);
  // a world of 5 ranks cannot give any rank more than 4 peers: the plan is the unbounded one
  PlanOptions small = o;
  small.world_size = 5;
  PlanOptions zero = small;
  zero.peer_budget = 0;
  EXPECT_EQ(makePlan({300, 20, 30}, small).serialize(), makePlan({300, 20, 30}, zero).serialize());
}

// WindowTree (naive / pow2's windows) against bestWindow's scan, on keys that stay integers (so
// every sum is exact and ties resolve the same): random interval adds, widths mostly shrinking
// (as the strategies ask for them) with some growing ones, worlds that are and are not powers
// of two.
TEST(PeerBudget, WindowTreeMatchesTheScan) {
  std::mt19937_64 rng(7);
  for (int W : {1, 2, 3, 5, 8, 13, 64, 100, 257}) {
    detail::WindowTree tree(W);
    std::vector<double> key(W, 0.0);
    int d = W;
    for (int step = 0; step < 400; ++step) {
      if (rng() % 5 == 0) d = 1 + static_cast<int>(rng() % W);
      else if (d > 1 && rng() % 3 == 0) --d;
      const int a = tree.best(d);
      ASSERT_EQ(a, detail::bestWindow(key, d)) << "W " << W << " d " << d << " step " << step;
      const double v = static_cast<double>(rng() % 4);  // 0 makes exact ties
      // the chosen window, or another interval now and then
      int a2 = a, d2 = d;
      if (rng() % 4 == 0) {
        d2 = 1 + static_cast<int>(rng() % W);
        a2 = static_cast<int>(rng() % (W - d2 + 1));
      }
      tree.add(a2, d2, v);
      for (int r = a2; r < a2 + d2; ++r) key[r] += v;
    }
    EXPECT_EQ(tree.best(0), -1);
    EXPECT_EQ(tree.best(W + 1), -1);
  }
}

// IntervalTimeline (balanced's intervals, its time order kept across occupy() calls) against a
// scan of every rank, on integer free times (exact wastes, so ties resolve the same): after random
// occupies (the chosen interval mostly), freeAt / freeTimes / each match the ranks' times and
// choose() the rule: from the earliest time an interval of lo ranks is free, at most `cand`
// distinct times; at each the size from the sizer and the window of least waste (then lowest
// start); the least waste wins (then the earliest), a zero waste ends the search.
TEST(PeerBudget, IntervalTimelineMatchesTheScan) {
  std::mt19937_64 rng(11);
  for (int W : {1, 2, 7, 40, 130}) {
    detail::IntervalTimeline tl(W);
    std::vector<double> f(W, 0.0);
    for (int step = 0; step < 300; ++step) {
      const int lo = 1 + static_cast<int>(rng() % std::min(W, 9));
      const int cap = lo + static_cast<int>(rng() % 5);
      const int cand = 1 + static_cast<int>(rng() % 8);
      const int bump = static_cast<int>(rng() % 3);
      auto sizer = [&](double t, int avail) {
        const int d = std::min(avail, lo + (static_cast<int>(t) + bump) % 3);
        return detail::IntervalTimeline::Size{d, true, t + d};
      };
      auto widest = [&](double t) {
        int w = 0, run = 0;
        for (int r = 0; r < W; ++r) w = std::max(w, run = f[r] <= t ? run + 1 : 0);
        return w;
      };
      std::vector<double> times(f);
      std::sort(times.begin(), times.end());
      times.erase(std::unique(times.begin(), times.end()), times.end());
      bool have = false;
      int bs = -1, bd = 0, seen = 0;
      double bt = 0, bw = 0;
      for (double t : times) {
        if (widest(t) < lo) continue;
        if (have && seen >= cand) break;
        ++seen;
        const int d = sizer(t, std::min(widest(t), cap)).d;
        int s = -1;
        double w = 0;
        for (int a = 0; a + d <= W; ++a) {
          double sum = 0;
          bool ok = true;
          for (int r = a; r < a + d; ++r) ok = ok && f[r] <= t, sum += t - f[r];
          if (ok && (s < 0 || sum < w)) s = a, w = sum;
        }
        if (s < 0) continue;
        if (!have || w < bw) have = true, bs = s, bd = d, bt = t, bw = w;
        if (bw == 0) break;
      }
      const detail::IntervalTimeline::Choice c = tl.choose(lo, cap, cand, 1e18, sizer);
      ASSERT_EQ(c.start, bs) << "W " << W << " step " << step;
      ASSERT_EQ(c.d, bd);
      ASSERT_EQ(c.t, bt);
      // occupy the choice, or another interval now and then, until after its ranks are free
      int a = c.start, d = c.d;
      if (rng() % 4 == 0) {
        d = 1 + static_cast<int>(rng() % W);
        a = static_cast<int>(rng() % (W - d + 1));
      }
      double until = 0;
      for (int r = a; r < a + d; ++r) until = std::max(until, f[r]);
      until += static_cast<double>(rng() % 4);  // 0 makes equal times
      tl.occupy(a, d, until);
      for (int r = a; r < a + d; ++r) f[r] = until;
      for (int r = 0; r < W; ++r) ASSERT_EQ(tl.freeAt(r), f[r]);
      std::vector<double> got;
      tl.freeTimes(a, d, got);
      ASSERT_EQ(got, std::vector<double>(f.begin() + a, f.begin() + a + d));
      std::vector<double> each(W, -1.0);
      tl.each([&](int r, double t) { each[r] = t; });
      ASSERT_EQ(each, f);
    }
  }
}
