// The one agreement primitive of bytescale: the members of a group exchange a fixed-size digest
// (comm/checks.h: a header naming the kind of agreement, then up to kAgreementPayload int64
// values) and every member gets the same table of all members' digests, so every member takes the
// same decision and raises the same error. Three checks use it:
//   * the consistency check of collectives (comm/consistency.h), before CPU collectives and
//     before the group_ops collectives of device transports (CUDA dynamic groups, staged groups);
//   * ring attention's agreement check (attention/ring_agreement.h), before any K/V moves;
//   * the loader's plan check (bytescale.data.HDPLoader, through bytescale.comm.agree).
// Members that are in different kinds of agreement (one checks a collective while the other
// checks a ring) pair up message for message and all raise naming both kinds.
//
// Where it runs:
//   agree(tr, ...)       on the calling thread over `tr`'s exchange(): inside Transport::run bodies
//                        of CPU collectives, i.e. in the order of the transport's worker.
//   agree(*host, ...)    over a host channel (GlooTransport::exchangeNow): the world CPU
//                        transport's (hostChannel(), world ranks) or a static group's
//                        (hostChannelOf(), its ranks; Transport::agreementChannel picks),
//                        never queued behind communication: what a CUDA rank does (the NCCL
//                        stream is not involved, no device synchronisation), and what NCCL-order
//                        mode keeps outside its in-order queue. A blocking host round trip among
//                        the group's members: callers keep it to once per operation that needs it.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "comm/checks.h"
#include "comm/schedule.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {

// P2POp::tag of an agreement's messages: the CPU transport gives agreements tag channels of their
// own (gloo_transport.h), so an agreement message only ever pairs with another agreement message
// (same fixed size), never with a data message of an operation a peer issued in another order
// (which Gloo would abort the process over): ranks out of order then wait and time out, naming
// the peer, as NCCL ranks would hang.
constexpr int kAgreementTag = -2;

// Exchanges `payload` (at most kAgreementPayload values) of kind `kind` with every member of `g`
// (this process a member) and returns the members' payloads, row j = group rank j's, each padded
// with zeros to kAgreementPayload values. One round trip up to 16 members, a ring all-gather above.
// Raises c10::Error on every member when a member is in another kind of agreement.
std::vector<std::vector<int64_t>> agree(Transport& tr, const RankMap& g, AgreementKind kind,
                                        const std::vector<int64_t>& payload,
                                        const std::string& what);

// The host channel: the world CPU transport with exchange() never queued (nullptr without a
// bytescale world).
std::shared_ptr<Transport> hostChannel();
// The host channel of `cpu`, a CPU (Gloo) transport of any group, in that group's rank space
// (nullptr when `cpu` is not one).
std::shared_ptr<Transport> hostChannelOf(const std::shared_ptr<Transport>& cpu);

}  // namespace comm
}  // namespace bytescale
