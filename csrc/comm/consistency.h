// Cross-rank consistency checks of collectives.
//
// Gloo aborts the whole process when a message is larger than the posted receive, and a P2P
// algorithm whose members disagree on sizes deadlocks or corrupts, so before a CPU collective (and
// a collective of a CUDA dynamic group) the members compare a small fingerprint of the call (op, dtype, element count, shapes, root or
// reduce op) and every member raises the same clear error on a mismatch. On by default;
// BYTESCALE_CHECK_COLLECTIVES=0 (read once, common/env.h) or set_collective_checks(False) turns
// it off. Every rank must use the same setting: the check is itself a collective.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "comm/checks.h"
#include "comm/collective.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {

bool checksEnabled();
void setChecksEnabled(bool on);

// The fingerprint of `c` on this rank: kFingerprintLen int64 values (CPU tensor).
at::Tensor fingerprint(const Collective& c);
// table: (n, kFingerprintLen) int64 rows in group order. Throws naming the first mismatching rank
// and both views (the same message on every member).
void verifyFingerprints(const at::Tensor& table, const RankMap& g, const std::string& what);
// Exchanges fingerprints through the agreement primitive (comm/agreement.h) and verifies them;
// a no-op with checks off or one member. CPU transports: over `tr` (call it inside the
// collective's Transport::run body: the worker's order); other devices (CUDA dynamic groups): a
// host exchange at issue time over Transport::agreementChannel() (the host channel of the
// transport's rank space).
void checkConsistent(Transport& tr, const RankMap& g, const Collective& c);

}  // namespace comm
}  // namespace bytescale
