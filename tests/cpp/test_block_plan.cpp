// GoogleTest: the segment plans a fused varlen kernel runs per ring step (attention/block_plan.h)
// against a brute-force mask built from every token's (document, position).
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <utility>
#include <vector>

#include "attention/block_plan.h"
#include "common/zigzag.h"

using namespace bytescale;
using namespace bytescale::attention;

namespace {

struct Tok {
  int64_t doc, pos;
};

std::vector<Tok> shardTokens(const std::vector<int64_t>& lens, int64_t n, int64_t i) {
  std::vector<Tok> t;
  for (size_t d = 0; d < lens.size(); ++d)
    for (const auto& [a, b] : zigzag::local_ranges(lens[d], n, i))
      for (int64_t p = a; p < b; ++p) t.push_back({static_cast<int64_t>(d), p});
  return t;
}

using Pairs = std::set<std::pair<int64_t, int64_t>>;

Pairs bruteForce(const std::vector<Tok>& q, const std::vector<Tok>& k, bool causal) {
  Pairs s;
  for (size_t i = 0; i < q.size(); ++i)
    for (size_t j = 0; j < k.size(); ++j)
      if (q[i].doc == k[j].doc && (!causal || k[j].pos <= q[i].pos)) s.insert({i, j});
  return s;
}

Pairs fromPlan(const BlockPlan& p) {
  Pairs s;
  for (const auto& g : p.segs) {
    if (p.causal) EXPECT_EQ(g.qn, g.kn);
    for (int64_t i = 0; i < g.qn; ++i)
      for (int64_t j = 0; j < g.kn; ++j)
        if (!p.causal || j <= i) s.insert({g.q0 + i, g.k0 + j});
  }
  return s;
}

}  // namespace

// local_ranges (the order of a rank's tokens, used by the plans and the token metadata): chunk i
// then chunk 2N-1-i, the positions of all ranks together cover every token exactly once, and
// local_tokens / shard_tokens count the same tokens.
TEST(ZigZag, LocalRangesCoverEveryTokenOnceInChunkOrder) {
  for (int64_t n = 1; n <= 6; ++n)
    for (int64_t s = 0; s <= 4 * n + 3; ++s) {
      std::vector<int> seen(s, 0);
      for (int64_t i = 0; i < n; ++i) {
        const auto r = zigzag::local_ranges(s, n, i);
        EXPECT_EQ(r[0], zigzag::chunk(s, n, i));
        EXPECT_EQ(r[1], zigzag::chunk(s, n, 2 * n - 1 - i));
        int64_t count = 0;
        for (const auto& [a, b] : r)
          for (int64_t p = a; p < b; ++p, ++count) ++seen[p];
        EXPECT_EQ(count, zigzag::local_tokens(s, n, i));
        EXPECT_EQ(zigzag::shard_tokens({s, 2 * s + 1, 0}, n, i),
                  count + zigzag::local_tokens(2 * s + 1, n, i));
      }
      for (int64_t p = 0; p < s; ++p) ASSERT_EQ(seen[p], 1) << "s=" << s << " n=" << n << " p=" << p;
    }
}

TEST(BlockPlan, ZigzagMatchesBruteForceMask) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + rng() % 5;
    std::vector<int64_t> lens(1 + rng() % 4);
    for (auto& s : lens) s = rng() % 3 == 0 ? rng() % (2 * n + 1) : rng() % 97;  // short docs too
    const bool causal = rng() % 4 != 0;
    for (int64_t qp = 0; qp < n; ++qp)
      for (int64_t kp = 0; kp < n; ++kp) {
        auto q = shardTokens(lens, n, qp), k = shardTokens(lens, n, kp);
        BlockPlan p = zigzagPlan(lens, n, qp, kp, causal);
        ASSERT_EQ(p.q_rows, static_cast<int64_t>(q.size()));
        ASSERT_EQ(p.k_rows, static_cast<int64_t>(k.size()));
        Pairs want = bruteForce(q, k, causal);
        ASSERT_EQ(fromPlan(p), want) << "n=" << n << " qp=" << qp << " kp=" << kp;
        ASSERT_EQ(p.visiblePairs(), static_cast<int64_t>(want.size()));
        // Segments never overlap in query rows (a query row is written by one segment).
        std::set<int64_t> rows;
        for (const auto& g : p.segs)
          for (int64_t i = 0; i < g.qn; ++i) ASSERT_TRUE(rows.insert(g.q0 + i).second);
      }
  }
}

TEST(BlockPlan, ShapesOfTheThreeCausalCases) {
  const std::vector<int64_t> lens = {40, 17};
  const int64_t n = 4;
  auto diag = zigzagPlan(lens, n, 2, 2, true);
  EXPECT_TRUE(diag.causal);
  EXPECT_TRUE(diag.queriesContiguous());
  EXPECT_TRUE(diag.keysContiguous());
  auto below = zigzagPlan(lens, n, 2, 1, true);  // keys from an earlier position
  EXPECT_FALSE(below.causal);
  EXPECT_TRUE(below.queriesContiguous());
  EXPECT_FALSE(below.keysContiguous());  // first key chunk of each document only
  auto above = zigzagPlan(lens, n, 1, 3, true);
  EXPECT_FALSE(above.causal);
  EXPECT_FALSE(above.queriesContiguous());  // second query chunk of each document only
  EXPECT_TRUE(above.keysContiguous());
  auto full = zigzagPlan(lens, n, 1, 3, false);
  EXPECT_TRUE(full.queriesContiguous() && full.keysContiguous());
  EXPECT_EQ(full.maxQ(), zigzag::local_tokens(40, n, 1));
}

TEST(BlockPlan, LocalPlanSkipsEmptyDocuments) {
  auto p = localPlan({5, 0, 3}, true);
  ASSERT_EQ(p.segs.size(), 2u);
  EXPECT_EQ(p.segs[1].q0, 5);
  EXPECT_TRUE(p.queriesContiguous());
  EXPECT_EQ(p.visiblePairs(), 15 + 6);
  EXPECT_THROW(localPlan({-1}, true), std::invalid_argument);
  EXPECT_THROW(zigzagPlan({4}, 2, 2, 0, true), std::invalid_argument);
}
