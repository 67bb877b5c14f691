#include "planner/planner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "common/zigzag.h"
#include "planner/peer_budget.h"
#include "planner/pipeline.h"
#include "planner/replay.h"

namespace bytescale {
namespace planner {

Strategy parseStrategy(const std::string& name) {
  if (name == "naive") return Strategy::kNaive;
  if (name == "balanced") return Strategy::kBalanced;
  if (name == "pow2") return Strategy::kPow2;
  if (name == "static") return Strategy::kStatic;
  if (name == "pp-balance") return Strategy::kPPBalance;
  if (name == "pp-lockstep") return Strategy::kPPLockstep;
  throw std::invalid_argument("planner: unknown strategy '" + name +
                              "' (expected 'naive', 'balanced', 'pow2', 'static', 'pp-balance' or "
                              "'pp-lockstep')");
}

std::string strategyName(Strategy s) {
  switch (s) {
    case Strategy::kNaive: return "naive";
    case Strategy::kBalanced: return "balanced";
    case Strategy::kPow2: return "pow2";
    case Strategy::kStatic: return "static";
    case Strategy::kPPBalance: return "pp-balance";
    case Strategy::kPPLockstep: return "pp-lockstep";
  }
  return "?";
}

int64_t rankCapacity(const PlanOptions& opt, int rank) {
  double m = opt.memory.empty() ? 1.0 : opt.memory[rank];
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(opt.capacity * m + 1e-9)));
}

// ---- verification ------------------------------------------------------------------------------

void Plan::checkStructure() const {
  auto bad = [](const std::string& m) { throw std::invalid_argument("plan: " + m); };
  auto num = [](auto v) { return std::to_string(v); };
  const int W = world_size;
  if (W < 1) bad("world_size = " + num(W) + " (must be >= 1)");
  if (num_sequences < 0) bad("num_sequences = " + num(num_sequences));
  const int64_t M = numMicroBatches();
  if (static_cast<int>(rank_mb.size()) != W + 1)
    bad("rank_mb has " + num(rank_mb.size()) + " entries for world_size " + num(W));
  if (static_cast<int64_t>(mb_seg.size()) != M + 1 || static_cast<int64_t>(mb_offload.size()) != M ||
      static_cast<int64_t>(mb_cost.size()) != M || static_cast<int64_t>(mb_ring.size()) != M ||
      static_cast<int64_t>(mb_tokens.size()) != M)
    bad("micro-batch arrays disagree in length (" + num(M) + " micro-batches)");
  const int64_t S = static_cast<int64_t>(seg_seq.size());
  if (static_cast<int64_t>(seg_ring_size.size()) != S || static_cast<int64_t>(seg_ring_pos.size()) != S ||
      static_cast<int64_t>(seg_tokens.size()) != S)
    bad("segment arrays disagree in length");
  // Every sequence is held by at least one segment (bounds what readers allocate per sequence).
  if (num_sequences > S)
    bad("num_sequences = " + num(num_sequences) + " but only " + num(S) + " segments");
  if (static_cast<int>(rank_cost.size()) != W || static_cast<int>(rank_finish.size()) != W ||
      static_cast<int>(rank_idle.size()) != W)
    bad("per-rank arrays do not have world_size entries");
  if (ring_grp.empty()) bad("ring_grp is empty (needs rings + 1 offsets)");
  auto offsets = [&](const std::vector<int64_t>& o, int64_t end, const char* name) {
    if (o.front() != 0 || o.back() != end) bad(std::string(name) + " does not span [0, " + num(end) + "]");
    for (size_t i = 0; i + 1 < o.size(); ++i)
      if (o[i + 1] < o[i]) bad(std::string(name) + " decreases at " + num(i));
  };
  offsets(rank_mb, M, "rank_mb");
  offsets(mb_seg, S, "mb_seg");
  offsets(ring_grp, static_cast<int64_t>(grp_ranks.size()), "ring_grp");
  const int64_t R = numRings();
  for (int64_t k = 0; k < R; ++k)
    if (ring_grp[k + 1] == ring_grp[k]) bad("ring " + num(k) + " has an empty group");
  for (int32_t g : grp_ranks)
    if (g < 0 || g >= W) bad("group rank " + num(g) + " outside [0, " + num(W) + ")");
  for (int64_t k = 0; k < S; ++k)
    if (seg_seq[k] < 0 || seg_seq[k] >= num_sequences || seg_ring_size[k] < 1 ||
        seg_ring_pos[k] < 0 || seg_ring_pos[k] >= seg_ring_size[k] || seg_tokens[k] < 0)
      bad("segment " + num(k) + " (sequence " + num(seg_seq[k]) + ", ring " + num(seg_ring_pos[k]) +
          "/" + num(seg_ring_size[k]) + ", " + num(seg_tokens[k]) + " tokens) is out of range");
  for (int64_t m = 0; m < M; ++m) {
    if (mb_ring[m] < -1 || mb_ring[m] >= R)
      bad("micro-batch " + num(m) + " has ring id " + num(mb_ring[m]) + " outside [-1, " + num(R) + ")");
    if (mb_ring[m] >= 0) {
      if (mb_seg[m + 1] == mb_seg[m]) bad("ring micro-batch " + num(m) + " has no segment");
      // every segment of a ring micro-batch is sharded over the same ring at the same position
      for (int64_t k = mb_seg[m] + 1; k < mb_seg[m + 1]; ++k)
        if (seg_ring_size[k] != seg_ring_size[mb_seg[m]] || seg_ring_pos[k] != seg_ring_pos[mb_seg[m]])
          bad("ring micro-batch " + num(m) + " has segments at different ring sizes or positions");
    }
  }
  detail::checkPipelineStructure(*this);
}

void Plan::verify(const std::vector<int64_t>& lengths, const PlanOptions& opt) const {
  auto fail = [](const std::string& m) { throw std::logic_error("plan invariant violated: " + m); };
  try {
    checkStructure();
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  const int W = world_size;
  if (W != opt.world_size) fail("world size");
  if (num_sequences != static_cast<int64_t>(lengths.size())) fail("number of sequences");
  const int64_t n = static_cast<int64_t>(lengths.size());
  const int64_t R = numRings();
  // Under a binding peer budget every hop of every ring (the wrap included) spans <= 2 ranks.
  for (int64_t k = 0; detail::peerBounded(opt) && k < R; ++k)
    for (int64_t g = ring_grp[k], d = ring_grp[k + 1] - ring_grp[k], j = 0; j < d; ++j)
      if (std::abs(grp_ranks[g + j] - grp_ranks[g + (j + 1) % d]) > 2)
        fail("ring " + std::to_string(k) + " has a hop of more than 2 ranks (peer budget " +
             std::to_string(opt.peer_budget) + ")");
  std::vector<int64_t> local_count(n, 0), ring_of(n, 0), tokens_seen(n, 0);
  std::vector<int64_t> ring_mb(R, -1);  // the first micro-batch seen of each ring
  std::vector<std::vector<char>> ring_pos_seen(R);
  const int l = opt.cost.layers;
  for (int r = 0; r < W; ++r) {
    int64_t last_ring = -1;
    double cost_sum = 0;
    for (int64_t m = rank_mb[r]; m < rank_mb[r + 1]; ++m) {
      cost_sum += mb_cost[m];
      const int64_t s0 = mb_seg[m], s1 = mb_seg[m + 1];
      if (s1 <= s0) fail("empty micro-batch on rank " + std::to_string(r));
      int64_t tok = 0;
      for (int64_t k = s0; k < s1; ++k) tok += seg_tokens[k];
      if (tok != mb_tokens[m]) fail("micro-batch token count");
      if (mb_offload[m] < 0 || mb_offload[m] > 1) fail("offload ratio outside [0,1]");
      const int64_t id = mb_ring[m];
      if (id >= 0) {
        // Increasing ring ids along every list: every member meets a group's rings in the same
        // relative order, so the order cannot deadlock (local ones may sit anywhere).
        if (id <= last_ring) fail("ring order on rank " + std::to_string(r));
        last_ring = id;
        const int64_t g0 = ring_grp[id];
        const int d = static_cast<int>(ring_grp[id + 1] - g0);
        const int pos = seg_ring_pos[s0];
        if (pos >= d || grp_ranks[g0 + pos] != r) fail("rank not at its ring position");
        // the ring's sequences (one, or the static baseline's pack), each sharded zig-zag
        int64_t ring_len = 0;
        for (int64_t k = s0; k < s1; ++k) {
          const int64_t seq = seg_seq[k];
          if (seg_ring_size[k] != d) fail("ring size != group size");
          if (seg_ring_pos[k] != pos) fail("segments of one ring micro-batch at different positions");
          if (seg_tokens[k] != zigzag::local_tokens(lengths[seq], d, pos)) fail("zig-zag tokens");
          ring_len += lengths[seq];
          tokens_seen[seq] += seg_tokens[k];
        }
        // memory after offloading (Eq. 3): (2 + (1-r)(l-2)) Act(s) <= d * l * Act(cap_r), s the
        // tokens of the ring micro-batch (all its sequences)
        const double act_s = opt.cost.act(static_cast<double>(ring_len));
        const double act_c = opt.cost.act(static_cast<double>(rankCapacity(opt, r)));
        const double need = l > 2 ? (2.0 + (1.0 - mb_offload[m]) * (l - 2)) * act_s : l * act_s;
        if (need > d * l * act_c * (1 + 1e-9) + 1e-6)
          fail("ring micro-batch of sequence " + std::to_string(seg_seq[s0]) + " exceeds rank " +
               std::to_string(r) + "'s capacity");
        if (ring_mb[id] < 0) {
          ring_mb[id] = m;
          ring_pos_seen[id].assign(d, 0);
          for (int64_t k = s0; k < s1; ++k) ++ring_of[seg_seq[k]];
        } else {
          const int64_t f0 = mb_seg[ring_mb[id]], f1 = mb_seg[ring_mb[id] + 1];
          bool same = f1 - f0 == s1 - s0;
          for (int64_t k = 0; same && k < s1 - s0; ++k) same = seg_seq[f0 + k] == seg_seq[s0 + k];
          if (!same) fail("members of ring " + std::to_string(id) + " disagree on its sequences");
        }
        if (ring_pos_seen[id][pos]++) fail("ring position held twice");
      } else {
        if (mb_tokens[m] > rankCapacity(opt, r))
          fail("local micro-batch over rank " + std::to_string(r) + "'s capacity");
        for (int64_t k = s0; k < s1; ++k) {
          if (seg_ring_size[k] != 1 || seg_ring_pos[k] != 0) fail("local segment with a ring");
          if (seg_tokens[k] != lengths[seg_seq[k]]) fail("local segment not a whole sequence");
          ++local_count[seg_seq[k]];
          tokens_seen[seg_seq[k]] += seg_tokens[k];
        }
      }
    }
    if (std::abs(cost_sum - rank_cost[r]) > 1e-9 * std::max(1.0, cost_sum)) fail("rank cost");
  }
  for (int64_t id = 0; id < R; ++id) {
    if (ring_mb[id] < 0) fail("ring " + std::to_string(id) + " has no micro-batch");
    for (char c : ring_pos_seen[id])
      if (!c) fail("ring " + std::to_string(id) + " misses a position");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (local_count[i] + ring_of[i] != 1)
      fail("sequence " + std::to_string(i) + " placed " +
           std::to_string(local_count[i] + ring_of[i]) + " times");
    if (tokens_seen[i] != lengths[i]) fail("sequence " + std::to_string(i) + " tokens");
  }
  // The statistics are the replay's (which also proves the order deadlock-free).
  ReplayResult rep;
  try {
    rep = replay(*this);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  auto close = [](double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b)); };
  // A pipelined plan's step is the pipeline replay's (the flat one above proved its ring order).
  if (pipelined()) detail::verifyPipeline(*this, opt);
  else if (pp != opt.pipeline.stages) fail("pp is not the options' pipeline depth");
  if (!pipelined() && !close(makespan, rep.step_time)) fail("makespan is not the replayed step time");
  double sum = 0, mx = 0;
  for (int r = 0; r < W; ++r) {
    if (!pipelined() && !close(rank_finish[r], rep.rank_finish[r])) fail("rank_finish of rank " + std::to_string(r));
    if (!close(rank_idle[r], makespan - rank_cost[r]) && !(rank_idle[r] == 0 && rank_cost[r] > makespan))
      fail("rank_idle of rank " + std::to_string(r));
    sum += rank_cost[r];
    mx = std::max(mx, rank_cost[r]);
  }
  if (!close(max_busy, mx) || !close(mean_cost, W ? sum / W : 0)) fail("busy statistics");
  if (makespan + 1e-12 < max_busy * (1 - 1e-9)) fail("makespan below the busiest rank's sum");
  if (!close(lower_bound, std::max({bound_work, bound_piece, bound_waves})))
    fail("lower bound parts");
}

// ---- serialisation -----------------------------------------------------------------------------

namespace {
constexpr char kMagic[4] = {'B', 'S', 'P', 'L'};
// Version 2: a ring's group stored once (ring_grp) instead of per micro-batch (mb_grp);
// rank_finish, rank_idle, max_busy and the bound's three parts; makespan is the replayed (synchronised)
// step time and local micro-batches may sit between ring ones.
// Version 3: pipelines (pp, pp_fwd_share, mb_slot, mb_p2p). Version 2 bytes still read (pp = 1).
constexpr uint32_t kVersion = 3;

// One put / get per kind of field: arithmetic values as their bytes, arrays as a u64 count and
// their elements, strings as a u32 length and their bytes.
struct Writer {
  std::vector<uint8_t> out;
  void raw(const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_arithmetic_v<T>, "plan fields are numbers, arrays of numbers or strings");
    raw(&v, sizeof(T));
  }
  template <typename T>
  void put(const std::vector<T>& v) {
    put<uint64_t>(v.size());
    if (!v.empty()) raw(v.data(), v.size() * sizeof(T));
  }
  void put(const std::string& v) {
    put<uint32_t>(static_cast<uint32_t>(v.size()));
    raw(v.data(), v.size());
  }
};

struct Reader {
  const uint8_t* p;
  size_t n, i = 0;
  void raw(void* dst, size_t k) {
    if (i + k > n) throw std::invalid_argument("plan bytes: truncated at offset " + std::to_string(i));
    std::memcpy(dst, p + i, k);
    i += k;
  }
  template <typename T>
  void get(T& v) {
    static_assert(std::is_arithmetic_v<T>, "plan fields are numbers, arrays of numbers or strings");
    raw(&v, sizeof(T));
  }
  template <typename T>
  void get(std::vector<T>& v) {
    uint64_t k;
    get(k);
    if (k > (n - i) / sizeof(T)) throw std::invalid_argument("plan bytes: bad array length");
    v.resize(k);
    if (k) raw(v.data(), k * sizeof(T));
  }
  void get(std::string& v) {
    uint32_t k;
    get(k);
    if (k > 64) throw std::invalid_argument("plan bytes: bad strategy name");
    v.resize(k);
    raw(v.data(), k);
  }
};
}  // namespace

std::vector<uint8_t> Plan::serialize() const {
  Writer w;
  w.raw(kMagic, 4);
  w.put<uint32_t>(kVersion);
#define BYTESCALE_PUT(type, name, init, since, doc) w.put(name);
  BYTESCALE_PLAN_FIELDS(BYTESCALE_PUT)
#undef BYTESCALE_PUT
  return w.out;
}

Plan Plan::deserialize(const uint8_t* data, size_t size) {
  Reader r{data, size};
  char magic[4];
  r.raw(magic, 4);
  if (std::memcmp(magic, kMagic, 4) != 0) throw std::invalid_argument("plan bytes: bad magic");
  uint32_t v;
  r.get(v);
  if (v != kVersion && v != 2)
    throw std::invalid_argument("plan bytes: version " + std::to_string(v) + ", expected 2 or " +
                                std::to_string(kVersion));
  Plan p;  // fields newer than the bytes keep their defaults
#define BYTESCALE_GET(type, name, init, since, doc) \
  if (v >= (since)) r.get(p.name);
  BYTESCALE_PLAN_FIELDS(BYTESCALE_GET)
#undef BYTESCALE_GET
  if (r.i != size) throw std::invalid_argument("plan bytes: trailing data");
  p.checkStructure();
  return p;
}

}  // namespace planner
}  // namespace bytescale
