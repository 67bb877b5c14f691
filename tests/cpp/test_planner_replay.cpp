// GoogleTest: the replay of a plan in the runtime's model (csrc/planner/replay.h), FSDP2 lockstep
// slots, and robustness of the plan deserialiser.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "planner/planner.h"
#include "planner/replay.h"

using namespace bytescale::planner;

namespace {

// A hand-written schedule: per rank a list of items, each either a local micro-batch (ring -1)
// or a ring id; groups per ring.
struct Hand {
  int W;
  std::vector<std::vector<int64_t>> lists;  // per rank: ring id or -1
  std::vector<std::vector<int32_t>> groups;  // per ring
  std::vector<int64_t> rank_mb, mb_ring, ring_grp;
  std::vector<int32_t> grp_ranks;
  ScheduleView view() {
    rank_mb = {0};
    mb_ring.clear();
    for (auto& l : lists) {
      mb_ring.insert(mb_ring.end(), l.begin(), l.end());
      rank_mb.push_back(static_cast<int64_t>(mb_ring.size()));
    }
    ring_grp = {0};
    grp_ranks.clear();
    for (auto& g : groups) {
      grp_ranks.insert(grp_ranks.end(), g.begin(), g.end());
      ring_grp.push_back(static_cast<int64_t>(grp_ranks.size()));
    }
    ScheduleView v;
    v.world_size = W;
    v.rank_mb = rank_mb.data();
    v.num_mb = static_cast<int64_t>(mb_ring.size());
    v.mb_ring = mb_ring.data();
    v.num_rings = static_cast<int64_t>(groups.size());
    v.ring_grp = ring_grp.data();
    v.grp_ranks = grp_ranks.data();
    v.num_grp_ranks = static_cast<int64_t>(grp_ranks.size());
    return v;
  }
};

std::vector<int64_t> heavyTailed(std::mt19937_64& rng, int n, int64_t cap, int64_t longest) {
  std::vector<int64_t> v;
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < n; ++i) {
    const double x = u(rng);
    if (x < 0.8) v.push_back(1 + static_cast<int64_t>(u(rng) * cap / 2));
    else if (x < 0.95) v.push_back(1 + static_cast<int64_t>(u(rng) * cap * 2));
    else v.push_back(1 + static_cast<int64_t>(u(rng) * longest));
  }
  return v;
}

PlanOptions randomOptions(std::mt19937_64& rng, int trial) {
  PlanOptions o;
  o.world_size = 1 + static_cast<int>(rng() % 24);
  o.capacity = 64 + static_cast<int64_t>(rng() % 400);
  o.offload = trial % 2;
  o.cost.layers = 3 + trial % 6;
  o.cost.ring_latency = (trial % 3) * 1e-5;
  o.strategy = static_cast<Strategy>(trial % 3);
  if (trial % 4 == 3) {
    for (int r = 0; r < o.world_size; ++r) {
      o.speed.push_back(0.5 + (rng() % 4) * 0.25);
      o.memory.push_back(1.0 + (rng() % 3) * 0.5);
    }
  }
  return o;
}

}  // namespace

TEST(Replay, EqualShortSequencesReplayToTheirSum) {
  PlanOptions o;
  o.world_size = 1;
  o.capacity = 1000;
  std::vector<int64_t> lens(50, 100);
  for (Strategy st : {Strategy::kBalanced, Strategy::kNaive, Strategy::kPow2}) {
    o.strategy = st;
    Plan p = makePlan(lens, o);
    ReplayResult r = replay(p);
    double sum = 0;
    for (double c : p.mb_cost) sum += c;
    EXPECT_NEAR(r.step_time, 50 * o.cost.seqTime(100), 1e-9 * sum);
    EXPECT_NEAR(r.step_time, sum, 1e-12 * sum);
    EXPECT_DOUBLE_EQ(p.makespan, r.step_time);
    EXPECT_NEAR(r.rank_idle[0], 0.0, 1e-12 * sum);
  }
  // Several ranks, locals only: every rank finishes at its own sum, idle = step - sum.
  o.world_size = 4;
  o.strategy = Strategy::kBalanced;
  Plan p = makePlan(std::vector<int64_t>(37, 100), o);
  ReplayResult r = replay(p);
  double mx = 0;
  for (int k = 0; k < 4; ++k) {
    EXPECT_NEAR(r.rank_finish[k], p.rank_cost[k], 1e-12);
    EXPECT_NEAR(r.rank_idle[k], r.step_time - p.rank_cost[k], 1e-12);
    mx = std::max(mx, p.rank_cost[k]);
  }
  EXPECT_DOUBLE_EQ(r.step_time, mx);
}

TEST(Replay, HandBuiltScheduleTimes) {
  // rank 0: local(1), ring0 ; rank 1: ring0, ring1 ; rank 2: local(5), ring1
  Hand h{3, {{-1, 0}, {0, 1}, {-1, 1}}, {{0, 1}, {1, 2}}};
  ScheduleView v = h.view();
  // durations per micro-batch, in flat order: r0: 1, 2 ; r1: 3 (ring0 copy), 4 ; r2: 5, 1
  std::vector<double> d = {1, 2, 3, 4, 5, 1};
  ReplayResult r = replay(v, d.data(), 6);
  // ring0 starts at max(1, 0) = 1, lasts max(2, 3) = 3 -> ends 4 on ranks 0 and 1
  EXPECT_DOUBLE_EQ(r.mb_start[1], 1);
  EXPECT_DOUBLE_EQ(r.mb_end[1], 4);
  EXPECT_DOUBLE_EQ(r.mb_start[2], 1);
  EXPECT_DOUBLE_EQ(r.mb_end[2], 4);
  // ring1 starts at max(4, 5) = 5, lasts max(4, 1) = 4 -> ends 9 on ranks 1 and 2
  EXPECT_DOUBLE_EQ(r.mb_start[3], 5);
  EXPECT_DOUBLE_EQ(r.mb_end[5], 9);
  EXPECT_DOUBLE_EQ(r.step_time, 9);
  EXPECT_DOUBLE_EQ(r.rank_finish[0], 4);
  EXPECT_DOUBLE_EQ(r.rank_busy[1], 3 + 4);
  EXPECT_DOUBLE_EQ(r.rank_idle[1], 9 - 7);  // waited 1 before ring0 and 1 before ring1
  EXPECT_DOUBLE_EQ(r.rank_idle[0], 9 - 4);
}

TEST(Replay, RingNeverStartsBeforeItsLastMemberIsFree) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 90; ++trial) {
    PlanOptions o = randomOptions(rng, trial);
    auto lens = heavyTailed(rng, static_cast<int>(rng() % 60), o.capacity,
                            o.capacity * std::max(1, o.world_size / 2));
    Plan p;
    try {
      p = makePlan(lens, o);
    } catch (const std::invalid_argument&) {
      continue;  // a sequence needs more ranks than exist
    }
    // Random durations (not the plan's costs): the model must hold for any.
    std::uniform_real_distribution<double> u(0.0, 2.0);
    std::vector<double> d(p.numMicroBatches());
    for (double& x : d) x = u(rng);
    ReplayResult r = replay(p, d);
    std::map<int64_t, double> ring_ready;  // ring id -> latest member free time
    std::map<int64_t, double> ring_start;
    for (int k = 0; k < p.world_size; ++k) {
      double free = 0;
      for (int64_t m = p.rank_mb[k]; m < p.rank_mb[k + 1]; ++m) {
        EXPECT_GE(r.mb_start[m], free) << "trial " << trial;
        if (p.mb_ring[m] < 0) {
          EXPECT_DOUBLE_EQ(r.mb_start[m], free);  // a local starts when its rank is free
          EXPECT_DOUBLE_EQ(r.mb_end[m], free + d[m]);
        } else {
          double& ready = ring_ready[p.mb_ring[m]];
          ready = std::max(ready, free);
          EXPECT_GE(r.mb_end[m], r.mb_start[m] + d[m]);
          auto it = ring_start.find(p.mb_ring[m]);
          if (it == ring_start.end()) ring_start[p.mb_ring[m]] = r.mb_start[m];
          else EXPECT_DOUBLE_EQ(it->second, r.mb_start[m]);  // members start together
        }
        free = r.mb_end[m];
      }
      EXPECT_DOUBLE_EQ(r.rank_finish[k], free);
    }
    for (auto& [id, ready] : ring_ready) EXPECT_DOUBLE_EQ(ring_start[id], ready) << "ring " << id;
  }
}

TEST(Replay, DeadlockAndMalformedSchedulesRaise) {
  // Crossed order: rank 0 runs ring 0 then ring 1, rank 1 ring 1 then ring 0.
  Hand h{2, {{0, 1}, {1, 0}}, {{0, 1}, {0, 1}}};
  ScheduleView v = h.view();
  std::vector<double> d(4, 1.0);
  try {
    replay(v, d.data(), 4);
    FAIL() << "expected a deadlock error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0 waits in ring 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(lockstepSlots(v), std::invalid_argument);
  // A member that never lists the ring.
  Hand miss{2, {{0}, {-1}}, {{0, 1}}};
  v = miss.view();
  d.assign(2, 1.0);
  try {
    replay(v, d.data(), 2);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 finished without running it"), std::string::npos)
        << e.what();
  }
  // A rank running a ring it is not a member of.
  Hand wrong{3, {{0}, {-1}, {0}}, {{0, 1}}};
  v = wrong.view();
  d.assign(3, 1.0);
  EXPECT_THROW(replay(v, d.data(), 3), std::invalid_argument);
  // Bad durations, ids and groups.
  Hand ok{2, {{0}, {0}}, {{0, 1}}};
  v = ok.view();
  d = {1.0, -1.0};
  EXPECT_THROW(replay(v, d.data(), 2), std::invalid_argument);
  d = {1.0, std::nan("")};
  EXPECT_THROW(replay(v, d.data(), 2), std::invalid_argument);
  d = {1.0, 1.0};
  EXPECT_THROW(replay(v, d.data(), 1), std::invalid_argument);
  EXPECT_NO_THROW(replay(v, d.data(), 2));
  Hand badid{2, {{0}, {3}}, {{0, 1}}};
  v = badid.view();
  EXPECT_THROW(replay(v, d.data(), 2), std::invalid_argument);
  Hand badrank{2, {{0}, {0}}, {{0, 7}}};
  v = badrank.view();
  EXPECT_THROW(replay(v, d.data(), 2), std::invalid_argument);
  v.world_size = 0;
  EXPECT_THROW(replay(v, d.data(), 2), std::invalid_argument);
}

TEST(Replay, NoDeadlockForAnyOrderThePlannerEmits) {
  std::mt19937_64 rng(5);
  int planned = 0;
  for (int trial = 0; trial < 240; ++trial) {
    PlanOptions o = randomOptions(rng, trial);
    auto lens = heavyTailed(rng, static_cast<int>(rng() % 80), o.capacity,
                            o.capacity * std::max(1, o.world_size) * 3 / 4 + 1);
    Plan p;
    try {
      p = makePlan(lens, o);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("ranks"), std::string::npos) << e.what();
      continue;
    }
    ++planned;
    ASSERT_NO_THROW(p.verify(lens, o)) << "trial " << trial;
    ReplayResult r;
    ASSERT_NO_THROW(r = replay(p)) << "trial " << trial;
    EXPECT_NEAR(r.step_time, p.makespan, 1e-12 * std::max(1.0, p.makespan));
    EXPECT_GE(p.makespan * (1 + 1e-9), p.lower_bound) << "trial " << trial;
    EXPECT_GE(p.makespan * (1 + 1e-9), p.max_busy);
    ASSERT_NO_THROW(lockstepSlots(p));
  }
  EXPECT_GT(planned, 150);
}

TEST(Lockstep, MatchesTheLoadersExample) {
  // The loader test's example: ranks 0 and 2 share ring A, ranks 1 and 2 ring B.
  // rank 0: A, L3, L4 ; rank 1: B, L5 ; rank 2: A, B
  Hand h{3, {{0, -1, -1}, {1, -1}, {0, 1}}, {{0, 2}, {1, 2}}};
  LockstepSlots s = lockstepSlots(h.view());
  ASSERT_EQ(s.num_slots, 3);
  // A in slot 0 on ranks 0 and 2; B in slot 1 on ranks 1 and 2; locals fill the rest in order.
  EXPECT_EQ(s.at(0, 0), 0);
  EXPECT_EQ(s.at(2, 0), 5);
  EXPECT_EQ(s.at(1, 1), 3);
  EXPECT_EQ(s.at(2, 1), 6);
  EXPECT_EQ(s.at(0, 1), 1);
  EXPECT_EQ(s.at(0, 2), 2);
  EXPECT_EQ(s.at(1, 0), 4);  // rank 1's local takes its first free slot
  EXPECT_EQ(s.at(1, 2), -1);
  EXPECT_EQ(s.at(2, 2), -1);
}

TEST(Lockstep, SlotsAreValidForPlannedBatches) {
  std::mt19937_64 rng(21);
  for (int trial = 0; trial < 120; ++trial) {
    PlanOptions o = randomOptions(rng, trial);
    auto lens = heavyTailed(rng, static_cast<int>(rng() % 70), o.capacity,
                            o.capacity * std::max(1, o.world_size) / 2 + 1);
    Plan p;
    try {
      p = makePlan(lens, o);
    } catch (const std::invalid_argument&) {
      continue;
    }
    LockstepSlots s = lockstepSlots(p);
    ASSERT_EQ(s.world_size, p.world_size);
    ASSERT_EQ(static_cast<int64_t>(s.mb.size()), p.world_size * s.num_slots);
    std::vector<int> seen(p.numMicroBatches(), 0);
    for (int r = 0; r < p.world_size; ++r) {
      int64_t last_ring_slot = -1, last_local = -1;
      for (int64_t k = 0; k < s.num_slots; ++k) {
        const int64_t m = s.at(r, k);
        if (m < 0) continue;
        ASSERT_GE(m, p.rank_mb[r]);  // a rank's slots hold its own micro-batches
        ASSERT_LT(m, p.rank_mb[r + 1]);
        ++seen[m];
        if (p.mb_ring[m] >= 0) {
          EXPECT_GT(m, last_ring_slot);  // rings keep the plan's order
          last_ring_slot = m;
          // every member of the ring holds it in the same slot
          const int64_t id = p.mb_ring[m];
          for (int64_t g = p.ring_grp[id]; g < p.ring_grp[id + 1]; ++g) {
            const int64_t q = s.at(p.grp_ranks[g], k);
            ASSERT_GE(q, 0);
            EXPECT_EQ(p.mb_ring[q], id);
          }
        } else {
          EXPECT_GT(m, last_local);  // locals keep the plan's order
          last_local = m;
        }
      }
    }
    for (int64_t m = 0; m < p.numMicroBatches(); ++m) EXPECT_EQ(seen[m], 1) << "micro-batch " << m;
    // no slot is empty on every rank
    for (int64_t k = 0; k < s.num_slots; ++k) {
      bool any = false;
      for (int r = 0; r < p.world_size; ++r) any = any || s.at(r, k) >= 0;
      EXPECT_TRUE(any) << "slot " << k;
    }
  }
}

TEST(PlanBytes, RoundTripAndCorruptionIsAnError) {
  std::mt19937_64 rng(9);
  PlanOptions o;
  o.world_size = 6;
  o.capacity = 300;
  auto lens = heavyTailed(rng, 60, 300, 1500);
  Plan p = makePlan(lens, o);
  auto bytes = p.serialize();
  Plan q = Plan::deserialize(bytes.data(), bytes.size());
  EXPECT_EQ(q.serialize(), bytes);
  EXPECT_DOUBLE_EQ(q.makespan, p.makespan);
  EXPECT_EQ(q.rank_idle, p.rank_idle);
  EXPECT_EQ(q.ring_grp, p.ring_grp);
  ASSERT_NO_THROW(q.verify(lens, o));
  // Random corruption: either a clear error or a plan whose structure holds (never a crash).
  int errors = 0;
  for (int k = 0; k < 3000; ++k) {
    auto b = bytes;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    size_t len = k % 7 == 0 ? rng() % b.size() : b.size();
    try {
      Plan c = Plan::deserialize(b.data(), len);
      c.checkStructure();
      try {
        replay(c);
        lockstepSlots(c);
      } catch (const std::invalid_argument&) {
        ++errors;  // e.g. a ring member changed: the replay names it
      }
    } catch (const std::invalid_argument&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 1000);
}

namespace {
// The byte format as written field by field before the field list (BYTESCALE_PLAN_FIELDS) generated
// it: the reference that the generated serialize() must reproduce byte for byte.
struct LegacyWriter {
  std::vector<uint8_t> out;
  void raw(const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <typename T>
  void pod(T v) { raw(&v, sizeof(T)); }
  template <typename T>
  void vec(const std::vector<T>& v) {
    pod<uint64_t>(v.size());
    if (!v.empty()) raw(v.data(), v.size() * sizeof(T));
  }
};

std::vector<uint8_t> legacyBytes(const Plan& p, uint32_t version) {
  LegacyWriter w;
  w.raw("BSPL", 4);
  w.pod<uint32_t>(version);
  w.pod<int32_t>(p.world_size);
  w.pod<int64_t>(p.num_sequences);
  w.pod<uint32_t>(static_cast<uint32_t>(p.strategy.size()));
  w.raw(p.strategy.data(), p.strategy.size());
  w.vec(p.rank_mb);
  w.vec(p.mb_seg);
  w.vec(p.mb_offload);
  w.vec(p.mb_cost);
  w.vec(p.mb_tokens);
  w.vec(p.mb_ring);
  w.vec(p.seg_seq);
  w.vec(p.seg_ring_size);
  w.vec(p.seg_ring_pos);
  w.vec(p.seg_tokens);
  w.vec(p.ring_grp);
  w.vec(p.grp_ranks);
  w.vec(p.rank_cost);
  w.vec(p.rank_finish);
  w.vec(p.rank_idle);
  for (double x : {p.makespan, p.max_busy, p.mean_cost, p.imbalance, p.lower_bound, p.bound_work, p.bound_piece,
                   p.bound_waves})
    w.pod<double>(x);
  if (version >= 3) {
    w.pod<int32_t>(p.pp);
    w.pod<double>(p.pp_fwd_share);
    w.vec(p.mb_slot);
    w.vec(p.mb_p2p);
  }
  return w.out;
}
}  // namespace

TEST(PlanBytes, TheFieldListWritesTheFormatFieldByField) {
  std::mt19937_64 rng(31);
  int planned = 0, pipelined = 0;
  for (int trial = 0; trial < 80; ++trial) {
    PlanOptions o = randomOptions(rng, trial);
    if (trial % 4 == 1) {
      o.pipeline.stages = 2;
      o.strategy = trial % 8 == 1 ? Strategy::kPPBalance : Strategy::kBalanced;
    }
    auto lens = heavyTailed(rng, static_cast<int>(rng() % 50), o.capacity,
                            o.capacity * std::max(1, o.world_size) / 2 + 1);
    Plan p;
    try {
      p = makePlan(lens, o);
    } catch (const std::invalid_argument&) {
      continue;
    }
    ++planned;
    pipelined += p.pipelined();
    const std::vector<uint8_t> bytes = p.serialize();
    ASSERT_EQ(bytes, legacyBytes(p, 3)) << "trial " << trial;
    if (p.pipelined()) continue;
    // Version 2 bytes (no pipeline fields) still read: the pipeline fields keep their defaults.
    const std::vector<uint8_t> v2 = legacyBytes(p, 2);
    Plan q = Plan::deserialize(v2.data(), v2.size());
    EXPECT_EQ(q.pp, 1);
    EXPECT_EQ(q.pp_fwd_share, 1.0 / 3);
    EXPECT_TRUE(q.mb_slot.empty() && q.mb_p2p.empty());
    if (p.pp == 1 && p.pp_fwd_share == 1.0 / 3) EXPECT_EQ(q.serialize(), bytes) << "trial " << trial;
  }
  EXPECT_GT(planned, 50);
  EXPECT_GT(pipelined, 5);
}
