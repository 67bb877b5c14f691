// The planner's feasibility rule (feasibility.h).
#include "planner/feasibility.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "planner/offload_rule.h"

namespace bytescale {
namespace planner {

bool placeable(const PlanOptions& opt, int64_t s, int64_t cap_min, int64_t cap_max) {
  return s <= cap_max || offloadFloor(opt, s, cap_min).ranks <= opt.world_size;
}

Feasibility::Feasibility(const PlanOptions& opt) : opt_(opt) {
  const int W = opt.world_size;
  if (W < 1) throw std::invalid_argument("feasibility: world_size must be >= 1, got " + std::to_string(W));
  if (opt.capacity < 1)
    throw std::invalid_argument("feasibility: capacity must be >= 1 token, got " + std::to_string(opt.capacity));
  if (!opt.memory.empty() && static_cast<int>(opt.memory.size()) != W)
    throw std::invalid_argument("feasibility: memory has " + std::to_string(opt.memory.size()) +
                                " entries for world_size " + std::to_string(W));
  for (double m : opt.memory)
    if (!(m > 0) || !std::isfinite(m)) throw std::invalid_argument("feasibility: memory multipliers must be positive");
  opt.cost.validate();
  cap_min_ = cap_max_ = rankCapacity(opt, 0);
  for (int r = 1; r < W; ++r) {
    cap_min_ = std::min(cap_min_, rankCapacity(opt, r));
    cap_max_ = std::max(cap_max_, rankCapacity(opt, r));
  }
  if (opt.strategy == Strategy::kStatic) {
    int cp = opt.static_cp;
    if (cp > 0 && (cp > W || W % cp != 0))
      throw std::invalid_argument("feasibility: static_cp = " + std::to_string(cp) + " does not divide world_size " +
                                  std::to_string(W));
    if (cp <= 0) {  // sized per step: a power of two, and it must divide the world (staticDpCp)
      cp = 1;
      while (W % (2 * cp) == 0) cp *= 2;
    }
    static_limit_ = std::min<int64_t>(kMaxSequence, static_cast<int64_t>(cp) * cap_min_);
  }
}

bool Feasibility::fits(int64_t s) const { return s >= 1 && s <= static_limit_ && memoryFits(s); }

namespace {

// The largest s in [lo, hi) with pred(s), given pred(lo) and !pred(hi) and pred monotone between.
template <class Pred>
int64_t lastTrue(int64_t lo, int64_t hi, const Pred& pred) {
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (pred(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace

int64_t Feasibility::longest() const {
  const CostModel& m = opt_.cost;
  const int64_t W = opt_.world_size;
  // Known failures bound every search (and keep the floors' rank counts far from int overflow):
  // without offloading ceil(s / C) > W ranks; with it even r = 1 leaves 2 Act(s) / (l Act(C)) > W.
  const int64_t hi0 = std::max(cap_max_ + 1, std::min(kMaxSequence, W * cap_min_ + 1));
  // Without offloading the floor max(ceil(Act(s)/Act(C)), ceil(s/C)) is monotone in s.
  auto no_offload = [&](int64_t s) { return s <= cap_max_ || ranksWithoutOffload(m, s, cap_min_) <= W; };
  int64_t good = no_offload(hi0) ? hi0 : lastTrue(cap_max_, hi0, no_offload);
  if (opt_.offload && m.layers > 2 && good < kMaxSequence) {
    // Beyond `good` a sequence fits only by offloading: it fits when Eq. 3's floor at the paper's
    // copy budget does (offload_rule's per-direction floor needs at least as many ranks), i.e. when
    // g(s) = (2 + (1 - r(s)) (l - 2)) Act(s) / (l Act(C)) <= W with r(s) = min(1, T(s) B / Act(s)).
    // Where r < 1, g = (l Act(s) - (l - 2) B T(s)) / (l Act(C)) is a concave quadratic (vertex
    // below); r < 1 between the roots of a1 s^2 + (b1 - a2/B) s + g - b2/B; elsewhere g = 2 Act(s)
    // / (l Act(C)) grows. Between consecutive breakpoints the rule is monotone.
    const double l = m.layers, B = std::min(m.bw_d2h, m.bw_h2d);
    const double act_c = m.act(static_cast<double>(cap_min_));
    const double bound = std::ceil((static_cast<double>(W) * l * act_c / 2 - m.b2) / m.a2) + 2;
    const int64_t hi1 = std::max(good + 1, bound < static_cast<double>(kMaxSequence)
                                               ? static_cast<int64_t>(bound) : kMaxSequence);
    std::vector<double> cuts;
    const double qa = m.a1, qb = m.b1 - m.a2 / B, qc = m.g - m.b2 / B;
    if (qa > 0) {
      const double disc = qb * qb - 4 * qa * qc;
      if (disc >= 0) {
        cuts.push_back((-qb - std::sqrt(disc)) / (2 * qa));
        cuts.push_back((-qb + std::sqrt(disc)) / (2 * qa));
      }
      cuts.push_back((l * m.a2 / ((l - 2) * B) - m.b1) / (2 * m.a1));  // the concave piece's vertex
    } else if (qb != 0) {
      cuts.push_back(-qc / qb);
    }
    std::vector<int64_t> points;
    for (double c : cuts)
      for (double v : {std::floor(c), std::ceil(c)})
        if (std::isfinite(v) && v > static_cast<double>(good) && v < static_cast<double>(hi1))
          points.push_back(static_cast<int64_t>(v));
    points.push_back(hi1);
    std::sort(points.begin(), points.end());
    auto mem = [&](int64_t s) { return memoryFits(s); };
    for (int64_t p : points) {
      if (!mem(p)) {  // monotone on [good, p], good fits, p does not: the first failure is inside
        good = lastTrue(good, p, mem);
        break;
      }
      good = p;  // both ends of a monotone piece fit: all of it does
    }
  }
  return std::min(good, static_limit_);
}

}  // namespace planner
}  // namespace bytescale
