// Collectives of a group written as point-to-point algorithms over a Transport: the executor of
// dynamic groups, and of the world backend for what Gloo lacks (AVG / PREMUL_SUM reductions,
// reduce-scatter, list all-to-all, coalesced all-gather).
//
// These functions run on the calling thread and are meant to be called inside Transport::run (so
// they execute on the CPU transport's worker thread, or enqueue on the CUDA transport's comm
// stream). The same code serves both transports; only exchange() differs. Every member of the group
// must make the same call; the arguments were checked by validate() (collective.h) on each member
// and, through run(), against the other members (consistency.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "comm/collective.h"
#include "comm/schedule.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {
namespace group_ops {

// Runs a validated collective: the cross-rank consistency check, then the algorithm below.
void run(Transport& tr, const RankMap& g, const Collective& c);

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
// Splits along dim 0 (rows), n entries each. One batched exchange.
void allToAll(Transport& tr, const RankMap& g, const at::Tensor& out, const at::Tensor& in,
              const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits,
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

}  // namespace group_ops
}  // namespace comm
}  // namespace bytescale
