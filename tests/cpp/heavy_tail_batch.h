// A test batch: document lengths like the paper's corpora, mostly short with a heavy tail.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace bytescale_test {

// `n` lengths: 75% up to `cap`, 20% up to 4 x `cap`, 5% up to `longest` (log-uniform within each).
inline std::vector<int64_t> heavyTailBatch(std::mt19937_64& rng, int n, int64_t cap, int64_t longest) {
  std::vector<int64_t> v;
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < n; ++i) {
    const double x = u(rng);
    const double hi = x < 0.75 ? cap : x < 0.95 ? 4.0 * cap : static_cast<double>(longest);
    v.push_back(std::max<int64_t>(1, static_cast<int64_t>(std::exp(u(rng) * std::log(hi)))));
  }
  return v;
}

}  // namespace bytescale_test
