// Ring agreement: before any K/V block moves, the members of a ring check that they describe the
// same call. A ring whose members disagree on the documents (say [96, 96] on one rank and [192] on
// the others: the same token counts per rank) would otherwise return silently wrong results, and
// other disagreements (dtype, head shapes, bf16 dK/dV traffic) hang or abort inside the transport.
//
// Phase 1 (every call): each member builds a fixed-size digest of its view (kDigestLen int64: the
// documents' count, sum and hash, the ring's size and ordered-ranks hash, dtype, query / kv heads,
// head dim, causal, resolved softmax scale, bf16 dK/dV traffic, and whether its own input checks
// passed) and the members exchange digests over the group sorted by global rank (so members that
// disagree on the ring ORDER still pair up): all-to-all in one round trip up to 16 members, a
// ring all-gather above. Every member then holds the same table and takes the same decision.
// Phase 2 (only on a mismatch): the two members named in the error send their full views
// (documents, ranks; or the text of their input error) so every member raises the same message
// naming both ranks and both views. Members that disagree on WHO is in the ring cannot pair up;
// they fail with the transport's timeout error, naming the peer that did not answer.
//
// On by default; BYTESCALE_CHECK_RING=0 (common/env.h) or setRingChecksEnabled(false) turns it
// off. Every member must use the same setting: the check is itself an exchange.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/schedule.h"
#include "comm/transport.h"

namespace bytescale {
namespace attention {

bool ringChecksEnabled();
void setRingChecksEnabled(bool on);

// One member's view of a ring attention call. Shape fields are -1 when the member's tensors were
// too malformed to read them (its `error` then says why).
struct RingView {
  std::vector<int64_t> doc_lens;
  std::vector<int64_t> ranks;  // the ring in this member's order
  int64_t dtype = -1;          // at::ScalarType
  int64_t q_heads = -1, kv_heads = -1, head_dim = -1;
  bool causal = false;
  double scale = 0;  // resolved (0 when unknown)
  bool bf16_grad_comm = false;
  std::string error;  // this member's own input check failure, empty when its inputs are valid
};

constexpr int kDigestLen = 14;

// The digest of a view (CPU int64 tensor of kDigestLen values).
at::Tensor ringDigest(const RingView& v);

// Agreement scopes: bytescale.attention.micro_batch_context enters one per micro-batch. Inside a
// scope a member checks a ring call only the first time it sees its digest (documents, ring,
// dtype, head shapes, causal, scale, bf16 traffic); later layers and the activation-checkpoint
// recompute of the same call skip the exchange (a blocking host round trip on CUDA). Every member
// of a ring runs the ring in one micro-batch, so all skip the same calls. Outside any scope every
// call is checked. Process-wide (the recompute runs on autograd's device thread on CUDA).
uint64_t enterAgreementScope();          // returns the scope it replaces (for exit)
void exitAgreementScope(uint64_t previous);
// Whether `v` (its input error ignored) was agreed in the current scope; remembers it as agreed
// when `remember` (after a check passed).
bool agreedInScope(const RingView& v, bool remember = false);
// Agreement exchanges this process ran for ring attention so far (tests count them).
int64_t ringAgreementExchanges();

// Exchanges digests among the ring's members (group: the ring, this process a member) through the
// agreement primitive (comm/agreement.h) over `tr` (the host channel, comm::hostChannel()) and
// throws the same c10::Error on every member when any member's inputs were invalid or the
// views differ. `what` names the op and ring for messages. Raises this member's own input error
// (after telling the others) when it has one. No-op for a ring of one.
void checkRingAgreement(comm::Transport& tr, const comm::RankMap& group, const RingView& mine,
                        const std::string& what);

}  // namespace attention
}  // namespace bytescale
