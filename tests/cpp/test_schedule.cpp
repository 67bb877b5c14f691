// GoogleTest: rank maps and the step schedules of the P2P algorithms (no processes needed).
// The schedules are checked by simulating every position of the ring in one process.
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <vector>

#include "common/zigzag.h"
#include "comm/schedule.h"

using namespace bytescale;
using namespace bytescale::comm;

TEST(RankMap, OrderAndLookup) {
  RankMap m({3, 0, 5}, 6, 0);
  EXPECT_EQ(m.size(), 3);
  EXPECT_EQ(m.myIndex(), 1);
  EXPECT_EQ(m.globalRank(2), 5);
  EXPECT_EQ(m.groupRankOf(5), 2);
  EXPECT_EQ(m.groupRankOf(4), -1);
  EXPECT_EQ(m.next(), 5);
  EXPECT_EQ(m.prev(), 3);
  EXPECT_EQ(m.describe(), "[3, 0, 5]");
}

TEST(RankMap, NonMemberAndErrors) {
  RankMap m({1, 2}, 4, 3);
  EXPECT_FALSE(m.isMember());
  EXPECT_THROW(m.requireMember("op"), std::runtime_error);
  EXPECT_THROW(RankMap({}, 4, 0), std::invalid_argument);
  EXPECT_THROW(RankMap({1, 1}, 4, 0), std::invalid_argument);
  EXPECT_THROW(RankMap({4}, 4, 0), std::invalid_argument);
  EXPECT_THROW(RankMap({-1}, 4, 0), std::invalid_argument);
  EXPECT_THROW(m.globalRank(2), std::out_of_range);
}

TEST(RankMap, SingleMemberRingIsItself) {
  RankMap m({2}, 3, 2);
  EXPECT_EQ(m.next(), 2);
  EXPECT_EQ(m.prev(), 2);
}

// Simulate a ring all-gather: after the schedule every position must hold every block, and what a
// position receives at a step is exactly what its predecessor sends at that step.
TEST(Schedules, RingAllGatherDeliversEveryBlock) {
  for (int n = 1; n <= 9; ++n) {
    std::vector<std::set<int>> have(n);
    for (int i = 0; i < n; ++i) have[i].insert(i);
    auto s0 = ringAllGatherSchedule(n, 0);
    ASSERT_EQ(static_cast<int>(s0.size()), n - 1);
    for (int step = 0; step < n - 1; ++step) {
      std::vector<std::set<int>> next = have;
      for (int i = 0; i < n; ++i) {
        int prev = (i - 1 + n) % n;
        auto mine = ringAllGatherSchedule(n, i)[step];
        auto theirs = ringAllGatherSchedule(n, prev)[step];
        ASSERT_EQ(mine.recv_block, theirs.send_block) << "n=" << n << " i=" << i;
        ASSERT_TRUE(have[prev].count(theirs.send_block)) << "sending a block not held yet";
        next[i].insert(mine.recv_block);
      }
      have = next;
    }
    for (int i = 0; i < n; ++i) EXPECT_EQ(static_cast<int>(have[i].size()), n);
  }
}

// Simulate a ring reduce-scatter with sets of contributors: position i must end with block i
// reduced over all positions, each contribution counted once.
TEST(Schedules, RingReduceScatterReducesEachBlockOnce) {
  for (int n = 1; n <= 9; ++n) {
    // partial[i][b] = multiset of contributors to block b held at position i
    std::vector<std::vector<std::vector<int>>> partial(n, std::vector<std::vector<int>>(n));
    for (int i = 0; i < n; ++i)
      for (int b = 0; b < n; ++b) partial[i][b] = {i};
    for (int step = 0; step < n - 1; ++step) {
      auto next = partial;
      for (int i = 0; i < n; ++i) {
        int prev = (i - 1 + n) % n;
        auto mine = ringReduceScatterSchedule(n, i)[step];
        auto theirs = ringReduceScatterSchedule(n, prev)[step];
        ASSERT_EQ(mine.recv_block, theirs.send_block);
        auto& dst = next[i][mine.recv_block];
        const auto& src = partial[prev][theirs.send_block];
        dst.insert(dst.end(), src.begin(), src.end());
      }
      partial = next;
    }
    for (int i = 0; i < n; ++i) {
      auto c = partial[i][i];
      std::sort(c.begin(), c.end());
      std::vector<int> all(n);
      std::iota(all.begin(), all.end(), 0);
      EXPECT_EQ(c, all) << "n=" << n << " position " << i;
    }
  }
}

TEST(Schedules, PairwiseExchangeMatchesPeers) {
  for (int n = 1; n <= 8; ++n) {
    for (int i = 0; i < n; ++i) {
      auto steps = pairwiseSchedule(n, i);
      ASSERT_EQ(static_cast<int>(steps.size()), n - 1);
      std::set<int> to, from;
      for (size_t s = 0; s < steps.size(); ++s) {
        to.insert(steps[s].send_to);
        from.insert(steps[s].recv_from);
        // the peer I send to at step s receives from me at step s
        EXPECT_EQ(pairwiseSchedule(n, steps[s].send_to)[s].recv_from, i);
      }
      EXPECT_EQ(static_cast<int>(to.size()), n - 1);
      EXPECT_EQ(static_cast<int>(from.size()), n - 1);
      EXPECT_FALSE(to.count(i));
    }
  }
}

TEST(Schedules, BlocksCoverEverythingOnce) {
  for (int64_t total : {0, 1, 7, 100, 1031}) {
    for (int n = 1; n <= 7; ++n) {
      int64_t covered = 0;
      for (int j = 0; j < n; ++j) {
        int64_t len = blockStart(total, n, j + 1) - blockStart(total, n, j);
        EXPECT_GE(len, total / n);
        EXPECT_LE(len, total / n + 1);
        covered += len;
      }
      EXPECT_EQ(covered, total);
    }
  }
  EXPECT_EQ(pipelineChunks(0), 1);
  EXPECT_EQ(pipelineChunks((1 << 20) + 1), 2);
}

TEST(ZigZag, ChunksPartitionAnyLength) {
  for (int64_t s : {0, 1, 2, 5, 17, 1000, 1023}) {
    for (int64_t n = 1; n <= 6; ++n) {
      std::vector<int> owner(s, -1);
      int64_t sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        auto [a, b] = zigzag::chunks_of(n, i);
        for (int64_t c : {a, b}) {
          auto [lo, hi] = zigzag::chunk(s, n, c);
          for (int64_t t = lo; t < hi; ++t) {
            ASSERT_EQ(owner[t], -1) << "token owned twice";
            owner[t] = static_cast<int>(i);
          }
        }
        sum += zigzag::local_tokens(s, n, i);
      }
      EXPECT_EQ(sum, s);
      for (int64_t t = 0; t < s; ++t) EXPECT_NE(owner[t], -1);
    }
  }
  EXPECT_THROW(zigzag::check(10, 0, 0), std::invalid_argument);
  EXPECT_THROW(zigzag::check(10, 2, 2), std::invalid_argument);
}
