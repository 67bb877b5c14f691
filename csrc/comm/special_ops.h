// Operations Gloo offers besides the collectives of collective.h, written once over a Transport
// for the world group and dynamic groups alike: the monitored barrier (how users find the rank that
// hangs) and all-reduce of sparse COO tensors. Both run on CPU tensors over the CPU transport.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <string>
#include <vector>

#include "comm/schedule.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {
namespace special_ops {

// Gloo's monitored barrier, on the calling thread. Every member but the first (group rank 0)
// sends "arrived" to it and waits for its "release" (group timeout; an error there names the first
// member). The first member waits for each arrival within `timeout` (measured from the call; with
// wait_all_ranks each arrival gets the whole timeout) and raises naming the global rank that did
// not arrive ("Rank 2 failed to pass monitoredBarrier in 100 ms"), or with wait_all_ranks every
// such rank ("Ranks 1, 2 failed ..."); it releases the others only when all arrived. `seq` makes
// each call's messages distinct (pass a per-group counter every member increments per call).
void monitoredBarrier(Transport& tr, const RankMap& g, std::chrono::milliseconds timeout,
                      bool wait_all_ranks, uint64_t seq, const std::string& what);

// Sums sparse COO CPU tensors over the group, as Gloo does: the local tensors are summed and
// coalesced, every member's indices and values are all-gathered, summed in group order and
// coalesced, and each tensor of `tensors` is replaced (copy_) by the result. Members must agree on
// sizes, sparse/dense dimensions and dtype (checked; a mismatch raises naming both views).
void sparseAllReduce(Transport& tr, const RankMap& g, const std::vector<at::Tensor>& tensors,
                     const std::string& what);

}  // namespace special_ops
}  // namespace comm
}  // namespace bytescale
