#include "planner/planner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "attention/zigzag.h"

namespace bytescale {
namespace planner {

Strategy parseStrategy(const std::string& name) {
  if (name == "naive") return Strategy::kNaive;
  if (name == "balanced") return Strategy::kBalanced;
  if (name == "pow2") return Strategy::kPow2;
  throw std::invalid_argument("planner: unknown strategy '" + name +
                              "' (expected 'naive', 'balanced' or 'pow2')");
}

std::string strategyName(Strategy s) {
  switch (s) {
    case Strategy::kNaive: return "naive";
    case Strategy::kBalanced: return "balanced";
    case Strategy::kPow2: return "pow2";
  }
  return "?";
}

int64_t rankCapacity(const PlanOptions& opt, int rank) {
  double m = opt.memory.empty() ? 1.0 : opt.memory[rank];
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(opt.capacity * m + 1e-9)));
}

namespace {

double speedOf(const PlanOptions& opt, int r) { return opt.speed.empty() ? 1.0 : opt.speed[r]; }

void validateInput(const std::vector<int64_t>& lengths, const PlanOptions& opt) {
  if (opt.world_size < 1)
    throw std::invalid_argument("planner: world_size must be >= 1, got " +
                                std::to_string(opt.world_size));
  if (opt.capacity < 1)
    throw std::invalid_argument("planner: capacity must be >= 1 token, got " +
                                std::to_string(opt.capacity));
  auto check_vec = [&](const std::vector<double>& v, const char* name) {
    if (v.empty()) return;
    if (static_cast<int>(v.size()) != opt.world_size)
      throw std::invalid_argument(std::string("planner: ") + name + " has " +
                                  std::to_string(v.size()) + " entries for world_size " +
                                  std::to_string(opt.world_size));
    for (size_t r = 0; r < v.size(); ++r)
      if (!(v[r] > 0) || !std::isfinite(v[r])) {
        std::ostringstream os;
        os << "planner: " << name << "[" << r << "] = " << v[r] << " must be positive";
        throw std::invalid_argument(os.str());
      }
  };
  check_vec(opt.speed, "speed");
  check_vec(opt.memory, "memory");
  opt.cost.validate();
  for (size_t i = 0; i < lengths.size(); ++i)
    if (lengths[i] <= 0)
      throw std::invalid_argument("planner: sequence " + std::to_string(i) + " has length " +
                                  std::to_string(lengths[i]) + " (lengths must be positive)");
}

// Offload ratio that lets a sequence of s tokens fit D ranks of capacity `cap` (0 if it fits
// without offloading). Assumes D >= the Eq. 3 minimum.
double ratioForRanks(const CostModel& m, int64_t s, int64_t cap, int d) {
  const int l = m.layers;
  const double act_s = m.act(static_cast<double>(s)), act_c = m.act(static_cast<double>(cap));
  if (act_s <= d * act_c * (1 + 1e-12) || l <= 2) return 0.0;
  double r = 1.0 - (d * l * act_c / act_s - 2.0) / (l - 2);
  return std::clamp(r, 0.0, 1.0);
}

// Builder of the flat plan.
struct Builder {
  const PlanOptions& opt;
  const std::vector<int64_t>& len;
  int W;
  // per rank: list of micro-batches (built as small structs, flattened at the end)
  struct MB {
    std::vector<std::tuple<int64_t, int32_t, int32_t, int64_t>> segs;  // seq, size, pos, tokens
    std::vector<int32_t> group;
    double offload = 0, cost = 0;
    int64_t tokens = 0;
    int64_t ring = -1;
  };
  std::vector<std::vector<MB>> per_rank;
  int64_t ring_counter = 0;

  Builder(const PlanOptions& o, const std::vector<int64_t>& l)
      : opt(o), len(l), W(o.world_size), per_rank(o.world_size) {}

  // One ring micro-batch on every member (members sorted: ring order = ascending rank).
  void addRing(int64_t seq, std::vector<int> members, double ratio) {
    std::sort(members.begin(), members.end());
    const int d = static_cast<int>(members.size());
    double min_speed = 1e300;
    for (int r : members) min_speed = std::min(min_speed, speedOf(opt, r));
    const double cost = opt.cost.shardedTime(static_cast<double>(len[seq]), d) / min_speed;
    for (int pos = 0; pos < d; ++pos) {
      MB mb;
      int64_t tok = zigzag::local_tokens(len[seq], d, pos);
      mb.segs.emplace_back(seq, d, pos, tok);
      mb.group.assign(members.begin(), members.end());
      mb.offload = ratio;
      mb.cost = cost;
      mb.tokens = tok;
      mb.ring = ring_counter;
      per_rank[members[pos]].push_back(std::move(mb));
    }
    ++ring_counter;
  }

  // Pack whole sequences into capacity-sized local micro-batches on rank r (best fit decreasing).
  void packLocal(int r, std::vector<int64_t> seqs) {
    std::stable_sort(seqs.begin(), seqs.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
    const int64_t cap = rankCapacity(opt, r);
    std::multimap<int64_t, size_t> free_space;  // remaining capacity -> index in per_rank[r]
    for (int64_t s : seqs) {
      auto it = free_space.lower_bound(len[s]);
      size_t idx;
      if (it == free_space.end()) {
        idx = per_rank[r].size();
        per_rank[r].emplace_back();
      } else {
        idx = it->second;
        free_space.erase(it);
      }
      MB& mb = per_rank[r][idx];
      mb.segs.emplace_back(s, 1, 0, len[s]);
      mb.tokens += len[s];
      mb.cost += opt.cost.seqTime(static_cast<double>(len[s])) / speedOf(opt, r);
      if (cap - mb.tokens > 0) free_space.emplace(cap - mb.tokens, idx);
    }
  }

  Plan finish(double lower_bound) {
    Plan p;
    p.world_size = W;
    p.strategy = strategyName(opt.strategy);
    p.num_sequences = static_cast<int64_t>(len.size());
    p.rank_mb.push_back(0);
    p.mb_seg.push_back(0);
    p.mb_grp.push_back(0);
    p.rank_cost.assign(W, 0.0);
    for (int r = 0; r < W; ++r) {
      // ring micro-batches first, in global ring order; local ones after, as packed
      auto& v = per_rank[r];
      std::stable_sort(v.begin(), v.end(), [](const MB& a, const MB& b) {
        bool ar = a.ring >= 0, br = b.ring >= 0;
        if (ar != br) return ar;
        return ar && a.ring < b.ring;
      });
      for (auto& mb : v) {
        for (auto& [seq, size, pos, tok] : mb.segs) {
          p.seg_seq.push_back(seq);
          p.seg_ring_size.push_back(size);
          p.seg_ring_pos.push_back(pos);
          p.seg_tokens.push_back(tok);
        }
        p.grp_ranks.insert(p.grp_ranks.end(), mb.group.begin(), mb.group.end());
        p.mb_seg.push_back(static_cast<int64_t>(p.seg_seq.size()));
        p.mb_grp.push_back(static_cast<int64_t>(p.grp_ranks.size()));
        p.mb_offload.push_back(mb.offload);
        p.mb_cost.push_back(mb.cost);
        p.mb_tokens.push_back(mb.tokens);
        p.mb_ring.push_back(mb.ring);
        p.rank_cost[r] += mb.cost;
      }
      p.rank_mb.push_back(static_cast<int64_t>(p.mb_tokens.size()));
    }
    double sum = 0, mx = 0;
    for (double c : p.rank_cost) {
      sum += c;
      mx = std::max(mx, c);
    }
    p.makespan = mx;
    p.mean_cost = sum / W;
    p.imbalance = p.mean_cost > 0 ? mx / p.mean_cost : 1.0;
    p.lower_bound = lower_bound;
    return p;
  }
};

using LoadHeap = std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>,
                                     std::greater<std::pair<double, int>>>;

std::vector<int> popLeast(LoadHeap& heap, int d) {
  std::vector<int> out;
  out.reserve(d);
  for (int k = 0; k < d; ++k) {
    out.push_back(heap.top().second);
    heap.pop();
  }
  return out;
}

int nextPow2(int d) {
  int p = 1;
  while (p < d) p <<= 1;
  return p;
}

}  // namespace

Plan makePlan(const std::vector<int64_t>& lengths, const PlanOptions& opt) {
  validateInput(lengths, opt);
  const int W = opt.world_size;
  const CostModel& cm = opt.cost;
  Builder b(opt, lengths);

  int64_t cap_min = rankCapacity(opt, 0), cap_max = cap_min;
  double speed_sum = 0, speed_max = 0, speed_min = 1e300;
  for (int r = 0; r < W; ++r) {
    cap_min = std::min(cap_min, rankCapacity(opt, r));
    cap_max = std::max(cap_max, rankCapacity(opt, r));
    speed_sum += speedOf(opt, r);
    speed_max = std::max(speed_max, speedOf(opt, r));
    speed_min = std::min(speed_min, speedOf(opt, r));
  }

  // Order: longest first; ties by input position (deterministic).
  const int64_t n = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b2) { return lengths[a] > lengths[b2]; });

  // Memory minimum of ranks (and offload ratio) for each sequence that cannot fit one rank.
  auto memMin = [&](int64_t s) -> OffloadChoice {
    if (opt.offload) return solveOffload(cm, s, cap_min);
    return {ranksWithoutOffload(cm, s, cap_min), 0.0};
  };

  // Lower bound on the makespan of any plan (under the cost model).
  double work = 0, piece = 0;
  for (int64_t i : order) {
    const int64_t s = lengths[i];
    if (s > cap_max) {
      int dmin = memMin(s).ranks;
      if (dmin > W) {
        std::ostringstream os;
        os << "planner: sequence " << i << " of " << s << " tokens needs " << dmin
           << " ranks at capacity " << cap_min << (opt.offload ? " (with offloading)" : "")
           << " but the world has " << W << " ranks";
        throw std::invalid_argument(os.str());
      }
      work += dmin * cm.shardedTime(static_cast<double>(s), dmin);
      // Sharded over any d <= W, a rank still computes at least its 1/W share (comm ignored).
      const double sd = static_cast<double>(s);
      const double best = cm.layers * (cm.a1 * sd * sd / W + cm.b1 * sd / W + cm.g);
      piece = std::max(piece, best / speed_max);
    } else {
      work += cm.seqTime(static_cast<double>(s));
      // Any sequence may be sharded (balanced does so for cost), so the indivisible piece is
      // again the 1/W share.
      const double sd = static_cast<double>(s);
      piece = std::max(piece, cm.layers * (cm.a1 * sd * sd / W + cm.b1 * sd / W + cm.g) / speed_max);
    }
  }
  const double lower_bound = std::max(work / speed_sum, piece);

  if (opt.strategy == Strategy::kBalanced) {
    const double target = work / speed_sum;
    LoadHeap heap;
    std::vector<double> load(W, 0.0);
    for (int r = 0; r < W; ++r) heap.emplace(0.0, r);
    std::vector<int64_t> shorts;
    // Ranks the remaining must-shard sequences need at least: growing one sequence's ring past
    // its memory minimum must not force later rings onto busy ranks (while one wave suffices).
    int64_t min_ranks_left = 0;
    for (int64_t i : order)
      if (lengths[i] > cap_max) min_ranks_left += memMin(lengths[i]).ranks;
    for (int64_t i : order) {
      const int64_t s = lengths[i];
      const bool is_long = s > cap_max;
      const int dmin_i = is_long ? memMin(s).ranks : 1;
      if (is_long) min_ranks_left -= dmin_i;
      const int64_t spare = min_ranks_left + dmin_i <= W ? W - min_ranks_left : W;
      const double t1 = cm.seqTime(static_cast<double>(s)) / speed_max;
      const bool must_shard = s > cap_max;
      const bool should_shard = W > 1 && t1 > target * 1.0001;
      if (!must_shard && !should_shard) {
        shorts.push_back(i);
        continue;
      }
      OffloadChoice mc = must_shard ? OffloadChoice{dmin_i, 0.0} : OffloadChoice{1, 0.0};
      int d = std::max(mc.ranks, must_shard ? 1 : 2);
      d = std::min(d, W);
      // By cost: more ranks while this sequence alone would run past the step's target and
      // another rank still shortens it.
      while (d < W && d < spare && cm.shardedTime(static_cast<double>(s), d) / speed_min > target &&
             cm.shardedTime(static_cast<double>(s), d + 1) <
                 cm.shardedTime(static_cast<double>(s), d) * 0.999)
        ++d;
      std::vector<int> members = popLeast(heap, d);
      double ms = 1e300;
      for (int r : members) ms = std::min(ms, speedOf(opt, r));
      const double c = cm.shardedTime(static_cast<double>(s), d) / ms;
      for (int r : members) {
        load[r] += c;
        heap.emplace(load[r], r);
      }
      b.addRing(i, members, opt.offload ? ratioForRanks(cm, s, cap_min, d) : 0.0);
    }
    // Short sequences: longest processing time first onto the rank that would finish earliest.
    // Ranks are grouped by (speed, capacity) class, one heap per class.
    std::map<std::pair<double, int64_t>, LoadHeap> classes;
    for (int r = 0; r < W; ++r) classes[{speedOf(opt, r), rankCapacity(opt, r)}].emplace(load[r], r);
    std::vector<std::vector<int64_t>> local(W);
    for (int64_t i : shorts) {
      const int64_t s = lengths[i];
      const double t = cm.seqTime(static_cast<double>(s));
      LoadHeap* best = nullptr;
      double best_finish = 0;
      int best_rank = 0;
      for (auto& [key, h] : classes) {
        if (key.second < s || h.empty()) continue;
        double fin = h.top().first + t / key.first;
        if (!best || fin < best_finish || (fin == best_finish && h.top().second < best_rank)) {
          best = &h;
          best_finish = fin;
          best_rank = h.top().second;
        }
      }
      if (!best)
        throw std::invalid_argument("planner: sequence " + std::to_string(i) + " of " +
                                    std::to_string(s) + " tokens fits no rank");
      best->pop();
      best->emplace(best_finish, best_rank);
      local[best_rank].push_back(i);
    }
    for (int r = 0; r < W; ++r) b.packLocal(r, local[r]);
  } else {
    // naive / pow2: balance TOKENS (memory), as the paper's Alg. 1 does.
    LoadHeap heap;
    std::vector<double> tokens(W, 0.0);
    for (int r = 0; r < W; ++r) heap.emplace(0.0, r);
    std::vector<int64_t> shorts;
    for (int64_t i : order) {
      const int64_t s = lengths[i];
      if (s <= cap_min) {
        shorts.push_back(i);
        continue;
      }
      OffloadChoice mc = memMin(s);
      int d = mc.ranks;
      if (opt.strategy == Strategy::kPow2) d = std::min(nextPow2(d), W);
      std::vector<int> members = popLeast(heap, d);
      for (int r : members) {
        tokens[r] += static_cast<double>(s) / d;
        heap.emplace(tokens[r], r);
      }
      b.addRing(i, members, opt.offload ? ratioForRanks(cm, s, cap_min, d) : 0.0);
    }
    // Best-fit decreasing into capacity-sized bins, bins to the rank with the fewest tokens.
    std::vector<std::vector<int64_t>> bins;
    std::vector<int64_t> fill;
    std::multimap<int64_t, size_t> free_space;
    for (int64_t i : shorts) {
      const int64_t s = lengths[i];
      auto it = free_space.lower_bound(s);
      size_t idx;
      if (it == free_space.end()) {
        idx = bins.size();
        bins.emplace_back();
        fill.push_back(0);
      } else {
        idx = it->second;
        free_space.erase(it);
      }
      bins[idx].push_back(i);
      fill[idx] += s;
      if (cap_min - fill[idx] > 0) free_space.emplace(cap_min - fill[idx], idx);
    }
    for (size_t k = 0; k < bins.size(); ++k) {
      auto top = heap.top();
      heap.pop();
      const int r = top.second;
      Builder::MB mb;
      for (int64_t i : bins[k]) {
        mb.segs.emplace_back(i, 1, 0, lengths[i]);
        mb.tokens += lengths[i];
        mb.cost += cm.seqTime(static_cast<double>(lengths[i])) / speedOf(opt, r);
      }
      b.per_rank[r].push_back(std::move(mb));
      tokens[r] += static_cast<double>(fill[k]);
      heap.emplace(tokens[r], r);
    }
  }
  return b.finish(lower_bound);
}

// ---- verification ------------------------------------------------------------------------------

void Plan::verify(const std::vector<int64_t>& lengths, const PlanOptions& opt) const {
  auto fail = [](const std::string& m) { throw std::logic_error("plan invariant violated: " + m); };
  const int W = world_size;
  if (W != opt.world_size) fail("world size");
  if (static_cast<int>(rank_mb.size()) != W + 1 || rank_mb.front() != 0) fail("rank_mb shape");
  const int64_t M = numMicroBatches();
  if (rank_mb.back() != M || static_cast<int64_t>(mb_seg.size()) != M + 1 ||
      static_cast<int64_t>(mb_grp.size()) != M + 1)
    fail("micro-batch arrays");
  const int64_t n = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> local_count(n, 0);
  // ring id -> (seq, size, positions seen)
  std::map<int64_t, std::tuple<int64_t, int, std::vector<int>, std::vector<int32_t>>> rings;
  std::vector<int64_t> tokens_seen(n, 0);
  const int l = opt.cost.layers;
  for (int r = 0; r < W; ++r) {
    int64_t last_ring = -1;
    bool seen_local = false;
    double cost_sum = 0;
    for (int64_t m = rank_mb[r]; m < rank_mb[r + 1]; ++m) {
      cost_sum += mb_cost[m];
      const int64_t s0 = mb_seg[m], s1 = mb_seg[m + 1];
      const int64_t g0 = mb_grp[m], g1 = mb_grp[m + 1];
      if (s1 <= s0) fail("empty micro-batch on rank " + std::to_string(r));
      int64_t tok = 0;
      for (int64_t k = s0; k < s1; ++k) tok += seg_tokens[k];
      if (tok != mb_tokens[m]) fail("micro-batch token count");
      if (mb_offload[m] < 0 || mb_offload[m] > 1) fail("offload ratio outside [0,1]");
      if (g1 > g0) {
        if (seen_local) fail("ring micro-batch after a local one on rank " + std::to_string(r));
        if (mb_ring[m] <= last_ring) fail("ring order on rank " + std::to_string(r));
        last_ring = mb_ring[m];
        if (s1 - s0 != 1) fail("ring micro-batch with several segments");
        const int d = static_cast<int>(g1 - g0);
        const int64_t seq = seg_seq[s0];
        const int pos = seg_ring_pos[s0];
        if (seg_ring_size[s0] != d) fail("ring size != group size");
        if (pos < 0 || pos >= d || grp_ranks[g0 + pos] != r) fail("rank not at its ring position");
        if (seg_tokens[s0] != zigzag::local_tokens(lengths[seq], d, pos)) fail("zig-zag tokens");
        // memory after offloading (Eq. 3): (2 + (1-r)(l-2)) Act(s) <= d * l * Act(cap_r)
        const double act_s = opt.cost.act(static_cast<double>(lengths[seq]));
        const double act_c = opt.cost.act(static_cast<double>(rankCapacity(opt, r)));
        const double need = l > 2 ? (2.0 + (1.0 - mb_offload[m]) * (l - 2)) * act_s : l * act_s;
        if (need > d * l * act_c * (1 + 1e-9) + 1e-6)
          fail("ring micro-batch of sequence " + std::to_string(seq) + " exceeds rank " +
               std::to_string(r) + "'s capacity");
        auto& e = rings[mb_ring[m]];
        if (std::get<2>(e).empty()) {
          std::get<0>(e) = seq;
          std::get<1>(e) = d;
          std::get<3>(e).assign(grp_ranks.begin() + g0, grp_ranks.begin() + g1);
        } else if (std::get<0>(e) != seq || std::get<1>(e) != d ||
                   !std::equal(std::get<3>(e).begin(), std::get<3>(e).end(), grp_ranks.begin() + g0)) {
          fail("members of a ring disagree on its sequence or group");
        }
        std::get<2>(e).push_back(pos);
        tokens_seen[seq] += seg_tokens[s0];
      } else {
        seen_local = true;
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
  std::vector<int> ring_of(n, 0);
  for (auto& [id, e] : rings) {
    auto pos = std::get<2>(e);
    std::sort(pos.begin(), pos.end());
    for (int k = 0; k < static_cast<int>(pos.size()); ++k)
      if (pos[k] != k || static_cast<int>(pos.size()) != std::get<1>(e)) fail("ring positions");
    ++ring_of[std::get<0>(e)];
  }
  for (int64_t i = 0; i < n; ++i) {
    if (local_count[i] + ring_of[i] != 1)
      fail("sequence " + std::to_string(i) + " placed " +
           std::to_string(local_count[i] + ring_of[i]) + " times");
    if (tokens_seen[i] != lengths[i]) fail("sequence " + std::to_string(i) + " tokens");
  }
}

// ---- serialisation -----------------------------------------------------------------------------

namespace {
constexpr char kMagic[4] = {'B', 'S', 'P', 'L'};
constexpr uint32_t kVersion = 1;

struct Writer {
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

struct Reader {
  const uint8_t* p;
  size_t n, i = 0;
  void raw(void* dst, size_t k) {
    if (i + k > n) throw std::invalid_argument("plan bytes: truncated at offset " + std::to_string(i));
    std::memcpy(dst, p + i, k);
    i += k;
  }
  template <typename T>
  T pod() {
    T v;
    raw(&v, sizeof(T));
    return v;
  }
  template <typename T>
  void vec(std::vector<T>& v) {
    uint64_t k = pod<uint64_t>();
    if (k > (n - i) / sizeof(T)) throw std::invalid_argument("plan bytes: bad array length");
    v.resize(k);
    if (k) raw(v.data(), k * sizeof(T));
  }
};
}  // namespace

std::vector<uint8_t> Plan::serialize() const {
  Writer w;
  w.raw(kMagic, 4);
  w.pod<uint32_t>(kVersion);
  w.pod<int32_t>(world_size);
  w.pod<int64_t>(num_sequences);
  w.pod<uint32_t>(static_cast<uint32_t>(strategy.size()));
  w.raw(strategy.data(), strategy.size());
  w.vec(rank_mb);
  w.vec(mb_seg);
  w.vec(mb_grp);
  w.vec(mb_offload);
  w.vec(mb_cost);
  w.vec(mb_tokens);
  w.vec(mb_ring);
  w.vec(seg_seq);
  w.vec(seg_ring_size);
  w.vec(seg_ring_pos);
  w.vec(seg_tokens);
  w.vec(grp_ranks);
  w.vec(rank_cost);
  w.pod<double>(makespan);
  w.pod<double>(mean_cost);
  w.pod<double>(imbalance);
  w.pod<double>(lower_bound);
  return w.out;
}

Plan Plan::deserialize(const uint8_t* data, size_t size) {
  Reader r{data, size};
  char magic[4];
  r.raw(magic, 4);
  if (std::memcmp(magic, kMagic, 4) != 0) throw std::invalid_argument("plan bytes: bad magic");
  uint32_t v = r.pod<uint32_t>();
  if (v != kVersion)
    throw std::invalid_argument("plan bytes: version " + std::to_string(v) + ", expected " +
                                std::to_string(kVersion));
  Plan p;
  p.world_size = r.pod<int32_t>();
  p.num_sequences = r.pod<int64_t>();
  uint32_t sl = r.pod<uint32_t>();
  if (sl > 64) throw std::invalid_argument("plan bytes: bad strategy name");
  p.strategy.resize(sl);
  r.raw(p.strategy.data(), sl);
  r.vec(p.rank_mb);
  r.vec(p.mb_seg);
  r.vec(p.mb_grp);
  r.vec(p.mb_offload);
  r.vec(p.mb_cost);
  r.vec(p.mb_tokens);
  r.vec(p.mb_ring);
  r.vec(p.seg_seq);
  r.vec(p.seg_ring_size);
  r.vec(p.seg_ring_pos);
  r.vec(p.seg_tokens);
  r.vec(p.grp_ranks);
  r.vec(p.rank_cost);
  p.makespan = r.pod<double>();
  p.mean_cost = r.pod<double>();
  p.imbalance = r.pod<double>();
  p.lower_bound = r.pod<double>();
  if (r.i != size) throw std::invalid_argument("plan bytes: trailing data");
  if (static_cast<int>(p.rank_mb.size()) != p.world_size + 1)
    throw std::invalid_argument("plan bytes: inconsistent world size");
  return p;
}

}  // namespace planner
}  // namespace bytescale
