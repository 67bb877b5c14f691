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

// The first row that differs from row 0, or -1 when all agree (rows of `len` values).
int firstMismatchingRow(const int64_t* rows, int n, int len = kFingerprintLen);

// ---- the agreement primitive's digests (comm/agreement.h exchanges them) ---------------------
// Every cross-rank digest exchange of bytescale (the collective consistency check, ring
// attention's agreement check, the loader's plan check) sends one row of kAgreementLen int64
// values: a header naming the kind of agreement, then up to kAgreementPayload values of the kind
// (unused values 0). One fixed size, so two ranks that are in different agreements still pair up
// message for message and raise an error naming both kinds (Gloo aborts the process when a
// message is larger than the posted receive).
constexpr int kAgreementLen = 16;
constexpr int kAgreementPayload = kAgreementLen - 1;
enum class AgreementKind : int64_t { kCollective = 1, kRingAttention = 2, kPlan = 3, kUser = 4 };

int64_t agreementHeader(AgreementKind kind);
// "collective consistency check", "ring attention agreement check", "loader plan check", ...
std::string agreementKindName(int64_t header);
// A row: the header of `kind`, then `payload` (at most kAgreementPayload values; throws
// std::invalid_argument naming `what` otherwise), then zeros.
std::vector<int64_t> agreementRow(AgreementKind kind, const std::vector<int64_t>& payload,
                                  const std::string& what);
// n rows of kAgreementLen: the first row whose header differs from row 0's, or -1.
int firstKindMismatch(const int64_t* rows, int n);

// FNV-1a, folded over a sequence of values (the shape hash of a fingerprint).
inline uint64_t fnv1a(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; }
constexpr uint64_t kFnvOffset = 1469598103934665603ull;

}  // namespace comm
}  // namespace bytescale
