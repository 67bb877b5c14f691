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

int firstMismatchingRow(const int64_t* rows, int n, int len) {
  for (int j = 1; j < n; ++j)
    for (int k = 0; k < len; ++k)
      if (rows[static_cast<int64_t>(j) * len + k] != rows[k]) return j;
  return -1;
}

namespace {
constexpr int64_t kAgreementMagic = 0x4147520000LL;  // "AGR" << 16
}  // namespace

int64_t agreementHeader(AgreementKind kind) {
  return kAgreementMagic | static_cast<int64_t>(kind);
}

std::string agreementKindName(int64_t header) {
  if ((header & ~int64_t{0xFFFF}) != kAgreementMagic)
    return "an exchange that is not an agreement (header " + std::to_string(header) + ")";
  switch (static_cast<AgreementKind>(header & 0xFFFF)) {
    case AgreementKind::kCollective: return "the consistency check of a collective";
    case AgreementKind::kRingAttention: return "ring attention's agreement check";
    case AgreementKind::kPlan: return "the loader's plan check";
    case AgreementKind::kUser: return "bytescale.comm.agree";
  }
  return "an agreement of unknown kind " + std::to_string(header & 0xFFFF);
}

std::vector<int64_t> agreementRow(AgreementKind kind, const std::vector<int64_t>& payload,
                                  const std::string& what) {
  if (static_cast<int>(payload.size()) > kAgreementPayload)
    throw std::invalid_argument("bytescale " + what + ": an agreement digest holds at most " +
                                std::to_string(kAgreementPayload) + " values, got " +
                                std::to_string(payload.size()));
  std::vector<int64_t> row(kAgreementLen, 0);
  row[0] = agreementHeader(kind);
  for (size_t i = 0; i < payload.size(); ++i) row[i + 1] = payload[i];
  return row;
}

int firstKindMismatch(const int64_t* rows, int n) {
  for (int j = 1; j < n; ++j)
    if (rows[static_cast<int64_t>(j) * kAgreementLen] != rows[0]) return j;
  return -1;
}

}  // namespace comm
}  // namespace bytescale
