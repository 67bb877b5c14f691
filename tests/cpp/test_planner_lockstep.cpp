// GoogleTest: the expert-parallel lockstep slots and their replay (csrc/planner/lockstep.cpp): a
// hand-worked schedule, the independent sums of the two cases that have one, the invariants on
// planned batches, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include "planner/planner.h"
#include "planner/replay.h"

using namespace bytescale::planner;

namespace {

// Units 0..3, EP blocks {0, 1} and {2, 3}. Ring 0 joins units 1 and 2.
//   unit 0: m0 local (1 s), m1 local (3 s)    unit 1: m2 ring 0 (2 s)
//   unit 2: m3 ring 0 (1 s), m4 local (5 s)   unit 3: m5 local (1 s)
struct Example {
  std::vector<int64_t> rank_mb{0, 2, 3, 5, 6}, mb_ring{-1, -1, 0, 0, -1, -1}, ring_grp{0, 2};
  std::vector<int32_t> grp_ranks{1, 2};
  std::vector<double> d{1, 3, 2, 1, 5, 1};
  ScheduleView view() const {
    ScheduleView v;
    v.world_size = 4;
    v.rank_mb = rank_mb.data();
    v.num_mb = 6;
    v.mb_ring = mb_ring.data();
    v.num_rings = 1;
    v.ring_grp = ring_grp.data();
    v.grp_ranks = grp_ranks.data();
    v.num_grp_ranks = 2;
    return v;
  }
};

std::vector<int64_t> row(const LockstepSlots& s, int u) {
  return std::vector<int64_t>(s.mb.begin() + u * s.num_slots, s.mb.begin() + (u + 1) * s.num_slots);
}

}  // namespace

TEST(EpLockstep, SortsLocalsCostliestFirstAndKeepsRings) {
  Example ex;
  LockstepSlots s = lockstepSlots(ex.view());
  ASSERT_EQ(s.num_slots, 2);
  EXPECT_EQ(row(s, 0), (std::vector<int64_t>{0, 1}));  // plan order
  LockstepSlots g = groupLockstep(ex.view(), 2, ex.d.data(), 6);
  EXPECT_EQ(row(g, 0), (std::vector<int64_t>{1, 0}));  // 3 s before 1 s
  EXPECT_EQ(row(g, 1), (std::vector<int64_t>{2, -1}));
  EXPECT_EQ(row(g, 2), (std::vector<int64_t>{3, 4}));  // the ring keeps its slot
  EXPECT_EQ(row(g, 3), (std::vector<int64_t>{5, -1}));
  // ties keep the lower index first
  std::vector<double> tie{2, 2, 0, 0, 0, 0};
  g = groupLockstep(ex.view(), 2, tie.data(), 6);
  EXPECT_EQ(row(g, 0), (std::vector<int64_t>{0, 1}));
}

TEST(EpLockstep, SlotCountsPerBlock) {
  LockstepSlots s;
  s.world_size = 5;
  s.num_slots = 4;
  s.mb = {0, -1, -1, -1,  //
          -1, 1, -1, -1,  //
          2, -1, -1, -1,  //
          -1, -1, -1, -1,  //
          -1, -1, 3, -1};
  EXPECT_EQ(groupSlotCounts(s, 0), (std::vector<int64_t>{4, 4, 4, 4, 4}));
  EXPECT_EQ(groupSlotCounts(s, 1), (std::vector<int64_t>{1, 2, 1, 0, 3}));
  EXPECT_EQ(groupSlotCounts(s, 2), (std::vector<int64_t>{2, 2, 1, 1, 3}));  // the last block is unit 4 alone
  EXPECT_EQ(groupSlotCounts(s, 5), (std::vector<int64_t>{3, 3, 3, 3, 3}));
  EXPECT_THROW(groupSlotCounts(s, -1), std::invalid_argument);
}

TEST(EpLockstep, ReplayOfTheHandWorkedExample) {
  Example ex;
  const ScheduleView v = ex.view();
  // Blocks of 2: slot 0 joins everything through ring 0 (slowest: m1, 3 s); slot 1 per block.
  ReplayResult r = epSlotReplay(groupLockstep(v, 2, ex.d.data(), 6), 2, v, ex.d.data(), 6);
  EXPECT_EQ(r.mb_start, (std::vector<double>{3, 0, 0, 0, 3, 0}));
  EXPECT_EQ(r.mb_end, (std::vector<double>{4, 3, 3, 3, 8, 3}));
  EXPECT_EQ(r.rank_finish, (std::vector<double>{4, 4, 8, 8}));
  EXPECT_EQ(r.rank_busy, (std::vector<double>{4, 2, 6, 1}));
  EXPECT_EQ(r.rank_idle, (std::vector<double>{4, 6, 2, 7}));
  EXPECT_EQ(r.step_time, 8);
  // Blocks of one unit: the ring joins units 1 and 2 only; unit 1 and 3 stop after slot 0.
  r = epSlotReplay(groupLockstep(v, 1, ex.d.data(), 6), 1, v, ex.d.data(), 6);
  EXPECT_EQ(r.rank_finish, (std::vector<double>{4, 2, 7, 1}));
  EXPECT_EQ(r.step_time, 7);
  EXPECT_EQ(r.mb_start[4], 2);
}

TEST(EpLockstep, IndependentSumsOnPlannedBatches) {
  std::mt19937_64 rng(9);
  int checked = 0;
  for (int trial = 0; trial < 60; ++trial) {
    PlanOptions o;
    o.world_size = 1 + static_cast<int>(rng() % 8);
    o.capacity = 100 + static_cast<int64_t>(rng() % 200);
    o.strategy = static_cast<Strategy>(trial % 3);
    std::vector<int64_t> lens;
    const int n = 1 + static_cast<int>(rng() % 20);
    for (int i = 0; i < n; ++i) lens.push_back(1 + static_cast<int64_t>(rng() % (o.capacity * std::min(3, o.world_size))));
    Plan p;
    try {
      p = makePlan(lens, o);
    } catch (const std::invalid_argument&) {
      continue;
    }
    ++checked;
    const int W = p.world_size;
    std::vector<double> d(p.numMicroBatches());
    for (double& x : d) x = 0.5 + (rng() % 100) / 40.0;
    // One block: every slot costs its slowest micro-batch.
    LockstepSlots s = groupLockstep(scheduleOf(p), W, p.mb_cost.data(), p.numMicroBatches());
    const int64_t c = groupSlotCounts(s, W)[0];
    double want = 0;
    for (int64_t k = 0; k < c; ++k) {
      double mx = 0;
      for (int u = 0; u < W; ++u)
        if (s.at(u, k) >= 0) mx = std::max(mx, d[s.at(u, k)]);
      want += mx;
    }
    ReplayResult r = epSlotReplay(s, W, scheduleOf(p), d.data(), static_cast<int64_t>(d.size()));
    EXPECT_NEAR(r.step_time, want, 1e-12 * want) << "trial " << trial;
    // Every micro-batch once, each unit's within its block's count; a block's units end together.
    const std::vector<int64_t> counts = groupSlotCounts(s, 1);
    for (int u = 0; u < W; ++u) {
      std::vector<int64_t> mine;
      for (int64_t k = 0; k < s.num_slots; ++k)
        if (s.at(u, k) >= 0) {
          EXPECT_LT(k, counts[u]);
          mine.push_back(s.at(u, k));
        }
      std::sort(mine.begin(), mine.end());
      ASSERT_EQ(static_cast<int64_t>(mine.size()), p.rank_mb[u + 1] - p.rank_mb[u]);
      for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(mine[i], p.rank_mb[u] + static_cast<int64_t>(i));
      EXPECT_EQ(r.rank_finish[u], r.step_time);
    }
    // The plan's own costs: epReplay is groupLockstep + epSlotReplay.
    ReplayResult a = epReplay(p, 1), b = epSlotReplay(groupLockstep(p, 1), 1, scheduleOf(p), p.mb_cost.data(),
                                                      p.numMicroBatches());
    EXPECT_EQ(a.mb_start, b.mb_start);
    EXPECT_EQ(a.step_time, b.step_time);
  }
  EXPECT_GT(checked, 30);
}

TEST(EpLockstep, ErrorsNameTheProblem) {
  Example ex;
  const ScheduleView v = ex.view();
  LockstepSlots s = groupLockstep(v, 2, ex.d.data(), 6);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { groupLockstep(v, 3, ex.d.data(), 6); }).find("group 3 does not divide the 4 HDP units"),
            std::string::npos);
  EXPECT_NE(message([&] { groupLockstep(v, 2, ex.d.data(), 5); }).find("5 costs for 6"), std::string::npos);
  EXPECT_NE(message([&] { epSlotReplay(s, 0, v, ex.d.data(), 6); }).find("does not divide"), std::string::npos);
  std::vector<double> bad = ex.d;
  bad[2] = -1;
  EXPECT_NE(message([&] { epSlotReplay(s, 2, v, bad.data(), 6); }).find("6 finite durations >= 0"),
            std::string::npos);
  bad[2] = std::nan("");
  EXPECT_NE(message([&] { epSlotReplay(s, 2, v, bad.data(), 6); }).find("finite"), std::string::npos);
  EXPECT_NE(message([&] { sortLocalSlots(s, ex.mb_ring.data(), bad.data(), 6); }).find("NaN"), std::string::npos);
  LockstepSlots wrong = s;
  std::swap(wrong.mb[0], wrong.mb[2]);  // unit 0 holding unit 1's micro-batch
  EXPECT_NE(message([&] { epSlotReplay(wrong, 2, v, ex.d.data(), 6); }).find("not one of the unit's"),
            std::string::npos);
  wrong = s;
  wrong.mb.pop_back();
  EXPECT_NE(message([&] { groupSlotCounts(wrong, 1); }).find("shape"), std::string::npos);
}
