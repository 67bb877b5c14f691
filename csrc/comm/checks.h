// Torch-free pieces of the collective checks, shared by the front end (collective.cpp) and the
// cross-rank consistency check (consistency.cpp), and covered by GoogleTest (tests/cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bytescale {
namespace comm {

// The split sizes of an all-to-all along dim 0 for a group of n: empty means equal splits (dim0
// must then be divisible by n); otherwise n non-negative sizes summing to dim0. Throws
// std::invalid_argument naming `what` and `name` ("input" / "output").
std::vector<int64_t> normalizeSplits(std::vector<int64_t> splits, int64_t dim0, int n,
                                     const std::string& what, const char* name);

// Cross-rank fingerprints: n rows of kFingerprintLen int64 values (op, dtype, elements, tensors,
// shape hash, root or reduce op), one per group member in group order.
constexpr int kFingerprintLen = 6;

// The first row that differs from row 0, or -1 when all agree.
int firstMismatchingRow(const int64_t* rows, int n);

// FNV-1a, folded over a sequence of values (the shape hash of a fingerprint).
inline uint64_t fnv1a(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; }
constexpr uint64_t kFnvOffset = 1469598103934665603ull;

}  // namespace comm
}  // namespace bytescale
