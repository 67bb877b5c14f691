// Planning-only replay of many steps (benchmarks/bench_peers.py builds and runs it): plans a fresh
// batch per step with one strategy and counts every rank's distinct ring neighbours (the previous
// and the next member of each ring it is in) over all steps.
//
//   peer_steps WORLD STEPS STRATEGY CAPACITY BUDGET SEGMENTS_FILE [PP]
//
// SEGMENTS_FILE: the length distribution as lines "lo hi weight" (bytescale.data.synthetic's
// segments: a segment by weight, then a length log-uniform in [lo, hi]); a batch holds about
// WORLD x CAPACITY / 2 tokens; odd steps offload (not "static"). Prints one line of key=value.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "planner/planner.h"

using namespace bytescale::planner;

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: peer_steps WORLD STEPS STRATEGY CAPACITY BUDGET SEGMENTS_FILE [PP]\n");
    return 2;
  }
  const int W = std::stoi(argv[1]), steps = std::stoi(argv[2]);
  const Strategy strategy = parseStrategy(argv[3]);
  const int64_t cap = std::stoll(argv[4]);
  const int budget = std::stoi(argv[5]);
  const int pp = argc > 7 ? std::stoi(argv[7]) : 1;
  std::vector<double> lo, hi, w;
  {
    std::ifstream f(argv[6]);
    double a, b, c;
    while (f >> a >> b >> c) {
      lo.push_back(a);
      hi.push_back(b);
      w.push_back(c);
    }
  }
  if (lo.empty()) {
    std::fprintf(stderr, "peer_steps: no segments in %s\n", argv[6]);
    return 2;
  }
  std::mt19937_64 rng(12345 + W);
  std::discrete_distribution<int> seg(w.begin(), w.end());
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::set<int>> nb(W);
  double plan_s = 0;
  int64_t rings = 0;
  for (int step = 0; step < steps; ++step) {
    std::vector<int64_t> lens;
    int64_t tokens = 0;
    while (true) {
      const int k = seg(rng);
      const int64_t l = std::max<int64_t>(
          1, std::llround(std::exp(std::log(lo[k]) + u(rng) * (std::log(hi[k]) - std::log(lo[k])))));
      if (!lens.empty() && tokens + l > W * cap / 2) break;
      lens.push_back(l);
      tokens += l;
    }
    PlanOptions o;
    o.world_size = W;
    o.capacity = cap;
    o.strategy = strategy;
    o.peer_budget = budget;
    o.offload = strategy != Strategy::kStatic && step % 2 == 1;
    o.pipeline.stages = pp;
    if (pp > 1) o.cost.layers = std::max(1, o.cost.layers / pp);
    const auto t0 = std::chrono::steady_clock::now();
    const Plan p = makePlan(lens, o);
    plan_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rings += p.numRings();
    for (int64_t r = 0; r < p.numRings(); ++r) {
      const int64_t g0 = p.ring_grp[r], d = p.ring_grp[r + 1] - g0;
      if (d < 2) continue;
      for (int64_t j = 0; j < d; ++j) {
        const int a = p.grp_ranks[g0 + j], b = p.grp_ranks[g0 + (j + 1) % d];
        nb[a].insert(b);
        nb[b].insert(a);
      }
    }
  }
  size_t mx = 0, sum = 0;
  for (const auto& s : nb) {
    mx = std::max(mx, s.size());
    sum += s.size();
  }
  std::printf("world=%d strategy=%s budget=%d steps=%d rings=%lld max=%zu mean=%.2f plan_s_per_step=%.4f\n", W,
              argv[3], budget, steps, static_cast<long long>(rings), mx, static_cast<double>(sum) / W,
              plan_s / std::max(1, steps));
  return 0;
}
