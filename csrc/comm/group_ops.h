// Collectives of a dynamic group written as point-to-point algorithms over a Transport.
//
// These functions run on the calling thread and are meant to be called inside Transport::run (so
// they execute on the CPU transport's worker thread, or enqueue on the CUDA transport's comm
// stream). The same code serves both transports; only exchange() differs. Every member of the group
// must call the same function with matching shapes; errors name the group and the peer.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "comm/schedule.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {
namespace group_ops {

// Reduction ops the P2P algorithms support: SUM, AVG (floating types), PRODUCT, MIN, MAX,
// BAND/BOR/BXOR (integral and bool), PREMUL_SUM (factor applied to each contribution).
void checkReduceOp(const c10d::ReduceOp& op, const at::Tensor& t, const std::string& what);

// out: (n * in.numel()) elements laid out rank-major (group order); ring algorithm.
void allGather(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
               const std::string& what);
// in: (n * out.numel()) elements rank-major; out gets block g.myIndex() reduced; ring algorithm.
void reduceScatter(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
                   const c10d::ReduceOp& op, const std::string& what);
// In place. Small tensors: all-gather then reduce in group order; large: ring reduce-scatter +
// all-gather over uneven blocks. Every member ends with bit-identical values.
void allReduce(Transport& tr, const RankMap& g, const at::Tensor& t, const c10d::ReduceOp& op,
               const std::string& what);
// root is a GROUP rank. Chunked pipeline along the ring from root.
void broadcast(Transport& tr, const RankMap& g, const at::Tensor& t, int root,
               const std::string& what);
// Splits along dim 0 (rows); empty split vectors mean equal splits. One batched exchange.
void allToAll(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
              std::vector<int64_t> out_splits, std::vector<int64_t> in_splits,
              const std::string& what);
// List all-to-all: inputs[j] goes to group rank j, outputs[j] comes from group rank j.
void allToAllList(Transport& tr, const RankMap& g, const std::vector<at::Tensor>& outputs,
                  const std::vector<at::Tensor>& inputs, const std::string& what);
// root is a GROUP rank; outputs has n tensors on root (ignored elsewhere).
void gather(Transport& tr, const RankMap& g, const std::vector<at::Tensor>& outputs,
            const at::Tensor& in, int root, const std::string& what);
void scatter(Transport& tr, const RankMap& g, const at::Tensor& out,
             const std::vector<at::Tensor>& inputs, int root, const std::string& what);
// Reduce to root (group rank), reduction in group order at the root; t is in/out on root.
void reduce(Transport& tr, const RankMap& g, const at::Tensor& t, const c10d::ReduceOp& op,
            int root, const std::string& what);
void barrier(Transport& tr, const RankMap& g, const std::string& what);

// ---- cross-rank consistency checks ----------------------------------------------------------------
// Gloo aborts the whole process when a message is larger than the posted receive, so before a
// collective the members compare a small fingerprint (op, dtype, shape) through a fixed-size
// all-gather and every member raises the same clear error on a mismatch. On by default for CPU
// tensors; BYTESCALE_CHECK_COLLECTIVES=0 turns it off.
constexpr int kFingerprintLen = 6;
enum class OpCode : int64_t {
  kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kAllToAll, kGather, kScatter, kReduce,
  kBarrier
};
// shape_known=false: only op and dtype are compared (ops whose shapes differ legitimately).
at::Tensor fingerprint(OpCode op, const at::Tensor& t, bool shape_known, int64_t extra = 0);
// table: (n, kFingerprintLen) int64 rows in group order. Throws naming the first mismatching rank.
void verifyFingerprints(const at::Tensor& table, const RankMap& g, const std::string& what);
// The all-gather + verify over the transport (CPU transports only; a no-op elsewhere).
void checkConsistent(Transport& tr, const RankMap& g, OpCode op, const at::Tensor& t,
                     bool shape_known, int64_t extra, const std::string& what);
bool checksEnabled();
// Every rank must use the same setting (the check is itself a collective).
void setChecksEnabled(bool on);

}  // namespace group_ops
}  // namespace comm
}  // namespace bytescale
