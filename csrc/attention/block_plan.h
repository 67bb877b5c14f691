// Which rows of a query shard attend which rows of a K/V block, as contiguous segments
// (pure C++, no torch): the plan a fused varlen kernel (flash attention) runs for one ring step.
//
// In zig-zag sharding (zigzag.h) every document contributes, at each ring position, its chunk
// `pos` followed by its chunk `2N-1-pos`. For queries at position qp and keys at position kp the
// causal mask between the two chunk pairs of one document is one of three simple shapes:
//   kp == qp : causal on the concatenated pair (positions increase along it), equal lengths;
//   kp <  qp : both query chunks see key chunk kp fully and chunk 2N-1-kp not at all;
//   kp >  qp : query chunk qp sees nothing, query chunk 2N-1-qp sees both key chunks fully.
// So every ring step is ONE varlen attention call, uniformly causal (diagonal step) or uniformly
// unmasked, over one (query segment, key segment) pair per document. Without a causal mask every
// pair is the whole document shard. Empty segments are dropped.
#pragma once

#include <cstdint>
#include <vector>

namespace bytescale {
namespace attention {

struct Segment {
  int64_t q0 = 0, qn = 0;  // rows [q0, q0 + qn) of the query tensor
  int64_t k0 = 0, kn = 0;  // rows [k0, k0 + kn) of the key/value tensor
};

struct BlockPlan {
  bool causal = false;    // causal (top-left == bottom-right aligned: qn == kn) or unmasked
  int64_t q_rows = 0;     // rows of the query tensor
  int64_t k_rows = 0;     // rows of the key/value tensor
  std::vector<Segment> segs;

  bool empty() const { return segs.empty(); }
  // True when the segments' query rows are exactly [0, q_rows) in order (no gather needed).
  bool queriesContiguous() const;
  bool keysContiguous() const;
  int64_t maxQ() const;
  int64_t maxK() const;
  // Query pairs (row, key row) the plan lets attend, for tests.
  int64_t visiblePairs() const;
};

// Whole local documents (packed, in order): segment d is document d against itself.
BlockPlan localPlan(const std::vector<int64_t>& lens, bool causal);

// Queries at ring position qp against the K/V block of ring position kp of an n-rank ring, for
// documents `lens` sharded zig-zag.
BlockPlan zigzagPlan(const std::vector<int64_t>& lens, int64_t n, int64_t qp, int64_t kp, bool causal);

}  // namespace attention
}  // namespace bytescale
