#include "comm/checks.h"

#include <stdexcept>

namespace bytescale {
namespace comm {

std::vector<int64_t> normalizeSplits(std::vector<int64_t> splits, int64_t dim0, int n,
                                     const std::string& what, const char* name) {
  const std::string head = "bytescale " + what + ": " + name;
  if (n < 1) throw std::invalid_argument(head + ": group size " + std::to_string(n));
  if (splits.empty()) {
    if (dim0 % n != 0)
      throw std::invalid_argument(head + " dim 0 (" + std::to_string(dim0) +
                                  ") is not divisible by the group size " + std::to_string(n) +
                                  "; pass split sizes");
    splits.assign(n, dim0 / n);
    return splits;
  }
  if (static_cast<int64_t>(splits.size()) != n)
    throw std::invalid_argument(head + " has " + std::to_string(splits.size()) +
                                " split sizes for a group of " + std::to_string(n));
  int64_t sum = 0;
  for (size_t j = 0; j < splits.size(); ++j) {
    if (splits[j] < 0)
      throw std::invalid_argument(head + " split size " + std::to_string(j) + " is negative (" +
                                  std::to_string(splits[j]) + ")");
    sum += splits[j];
  }
  if (sum != dim0)
    throw std::invalid_argument(head + " split sizes sum to " + std::to_string(sum) +
                                " but dim 0 is " + std::to_string(dim0));
  return splits;
}

int firstMismatchingRow(const int64_t* rows, int n) {
  for (int j = 1; j < n; ++j)
    for (int k = 0; k < kFingerprintLen; ++k)
      if (rows[static_cast<int64_t>(j) * kFingerprintLen + k] != rows[k]) return j;
  return -1;
}

}  // namespace comm
}  // namespace bytescale
