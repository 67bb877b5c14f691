// Zig-zag sharding of one sequence over an N-rank ring (pure C++, no torch).
//
// A sequence of length s sharded over N ranks is cut into 2N chunks with bounds
//   b_j = floor(j * s / (2N)),  j = 0 .. 2N,   chunk j = [b_j, b_{j+1})
// and the rank at ring position i holds chunks i and 2N-1-i, in that order (its local tokens are
// chunk i followed by chunk 2N-1-i). Any length works: chunks differ by at most one token and may
// be empty when s < 2N. Under a causal mask every rank then does the same attention work up to
// rounding. This is the one C++ definition of the layout (in common/: attention and the planner both use
// it, neither owns it): the planner, the segment plans of ring
// steps (block_plan.cpp) and the token metadata of the tiled kernel (block_step.cpp) use it. The
// Python side mirrors it in one module (bytescale/attention/zigzag.py).
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace bytescale {
namespace zigzag {

// Start of chunk j (0 <= j <= 2N) of a length-s sequence split into 2N chunks.
inline int64_t chunk_start(int64_t s, int64_t n_ranks, int64_t j) {
  // j * s may overflow for absurd s; s <= 2^40 and 2N <= 2^20 keeps it in int64.
  return (j * s) / (2 * n_ranks);
}

// [start, end) of chunk j.
inline std::pair<int64_t, int64_t> chunk(int64_t s, int64_t n_ranks, int64_t j) {
  return {chunk_start(s, n_ranks, j), chunk_start(s, n_ranks, j + 1)};
}

// The two chunk indices held by ring position i.
inline std::pair<int64_t, int64_t> chunks_of(int64_t n_ranks, int64_t i) {
  return {i, 2 * n_ranks - 1 - i};
}

// The [start, end) token ranges of a length-s sequence held by ring position i, in the order of
// its local tokens: chunk i, then chunk 2N-1-i.
inline std::array<std::pair<int64_t, int64_t>, 2> local_ranges(int64_t s, int64_t n_ranks, int64_t i) {
  const auto c = chunks_of(n_ranks, i);
  return {chunk(s, n_ranks, c.first), chunk(s, n_ranks, c.second)};
}

// Number of tokens of a length-s sequence held by ring position i.
inline int64_t local_tokens(int64_t s, int64_t n_ranks, int64_t i) {
  const auto r = local_ranges(s, n_ranks, i);
  return (r[0].second - r[0].first) + (r[1].second - r[1].first);
}

// Number of tokens of packed sequences `lens`, each sharded over the ring, held by position i.
inline int64_t shard_tokens(const std::vector<int64_t>& lens, int64_t n_ranks, int64_t i) {
  int64_t t = 0;
  for (int64_t s : lens) t += local_tokens(s, n_ranks, i);
  return t;
}

inline void check(int64_t s, int64_t n_ranks, int64_t i) {
  if (s < 0) throw std::invalid_argument("zigzag: negative sequence length " + std::to_string(s));
  if (n_ranks < 1)
    throw std::invalid_argument("zigzag: ring size must be >= 1, got " + std::to_string(n_ranks));
  if (i < 0 || i >= n_ranks)
    throw std::invalid_argument("zigzag: ring position " + std::to_string(i) + " outside [0, " +
                                std::to_string(n_ranks) + ")");
}

}  // namespace zigzag
}  // namespace bytescale
