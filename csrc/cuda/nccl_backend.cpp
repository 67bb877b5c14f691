// See nccl_backend.h. STATUS: world size 1 run on one H200 (tests/test_cuda_backend.py,
// 2026-11-22); multi-GPU communicators never run (only single-GPU machines were lent).
#include "cuda/nccl_backend.h"

#include <ATen/ATen.h>
#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

namespace bytescale {
namespace cuda {

namespace {

#define BYTESCALE_CUDA(call)                                                              \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    TORCH_CHECK(e_ == cudaSuccess, "bytescale: CUDA error: ", cudaGetErrorString(e_));    \
  } while (0)

// A minimal CUDA event (raw runtime API; ATen's CUDAEvent header pulls in cuBLAS/cuSPARSE headers
// that a bare CUDA toolkit may lack).
class Event {
 public:
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (ev_) cudaEventDestroy(ev_);
  }
  void record(const c10::cuda::CUDAStream& s) {
    if (!ev_) BYTESCALE_CUDA(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    BYTESCALE_CUDA(cudaEventRecord(ev_, s.stream()));
  }
  // The stream waits for the event (GPU side).
  void block(const c10::cuda::CUDAStream& s) {
    if (ev_) BYTESCALE_CUDA(cudaStreamWaitEvent(s.stream(), ev_, 0));
  }
  bool query() const {
    if (!ev_) return true;
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    BYTESCALE_CUDA(e);
    return true;
  }
  void synchronize() {
    if (ev_) BYTESCALE_CUDA(cudaEventSynchronize(ev_));
  }

 private:
  cudaEvent_t ev_ = nullptr;
};

#define BYTESCALE_NCCL(call, what)                                                         \
  do {                                                                                     \
    ncclResult_t r_ = (call);                                                              \
    TORCH_CHECK(r_ == ncclSuccess, "bytescale ", what, ": NCCL error: ", ncclGetErrorString(r_)); \
  } while (0)

// Closes an NCCL group even when an exception unwinds between ncclGroupStart and ncclGroupEnd
// (an open group would silently queue every later NCCL call on this thread).
class GroupGuard {
 public:
  explicit GroupGuard(const char* what) : what_(what) {
    BYTESCALE_NCCL(ncclGroupStart(), what_);
    open_ = true;
  }
  void end() {
    open_ = false;
    BYTESCALE_NCCL(ncclGroupEnd(), what_);
  }
  ~GroupGuard() {
    if (open_) (void)ncclGroupEnd();
  }

 private:
  const char* what_;
  bool open_ = false;
};

ncclDataType_t ncclType(at::ScalarType t, const std::string& what) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    case at::kBool: return ncclUint8;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default:
      TORCH_CHECK(false, "bytescale ", what, ": dtype ", t, " is not supported by NCCL");
  }
}

struct RedOp {
  ncclRedOp_t op;
  bool created = false;  // a PREMUL_SUM op to destroy after use
};

RedOp ncclOp(const c10d::ReduceOp& op, const at::Tensor& t, ncclComm_t comm, const std::string& what) {
  const bool is_bool = t.scalar_type() == at::kBool;  // uint8 on the wire: SUM = OR, PRODUCT = AND
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return {is_bool ? ncclMax : ncclSum};
    case c10d::ReduceOp::PRODUCT: return {is_bool ? ncclMin : ncclProd};
    case c10d::ReduceOp::MIN: return {ncclMin};
    case c10d::ReduceOp::MAX: return {ncclMax};
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(at::isFloatingType(t.scalar_type()), "bytescale ", what,
                  ": ReduceOp.AVG needs a floating dtype, got ", t.scalar_type());
      return {ncclAvg};
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(sup, "bytescale ", what, ": PREMUL_SUM without a factor");
      TORCH_CHECK(!sup->tensor_factor.defined() || sup->tensor_factor.numel() == 1, "bytescale ",
                  what, ": PREMUL_SUM factor must be a scalar");
      double f = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
      ncclRedOp_t r;
      ncclDataType_t dt = ncclType(t.scalar_type(), what);
      if (t.scalar_type() == at::kDouble) {
        BYTESCALE_NCCL(ncclRedOpCreatePreMulSum(&r, &f, dt, ncclScalarHostImmediate, comm), what);
      } else {
        float ff = static_cast<float>(f);
        at::Half hf = static_cast<at::Half>(f);
        at::BFloat16 bf = static_cast<at::BFloat16>(f);
        void* scalar = t.scalar_type() == at::kHalf ? static_cast<void*>(&hf)
                       : t.scalar_type() == at::kBFloat16 ? static_cast<void*>(&bf)
                                                          : static_cast<void*>(&ff);
        BYTESCALE_NCCL(ncclRedOpCreatePreMulSum(&r, scalar, dt, ncclScalarHostImmediate, comm), what);
      }
      return {r, true};
    }
    default:
      TORCH_CHECK(false, "bytescale ", what, ": reduce op ", static_cast<int>(op.op_),
                  " (bitwise) is not supported by NCCL");
  }
}

void checkCuda(const std::vector<at::Tensor>& ts, const std::string& what) {
  TORCH_CHECK(!ts.empty(), "bytescale ", what, ": no tensors");
  for (const auto& t : ts) {
    TORCH_CHECK(t.is_cuda(), "bytescale ", what, ": expected CUDA tensors, got ", t.device());
    TORCH_CHECK(t.is_contiguous(), "bytescale ", what, ": tensors must be contiguous (shape ",
                t.sizes(), ")");
    TORCH_CHECK(t.device() == ts[0].device(), "bytescale ", what, ": tensors on ", ts[0].device(),
                " and ", t.device());
  }
}

class NcclBackend;

// Work with ProcessGroupNCCL semantics (see header).
class NcclWork : public c10d::Work {
 public:
  NcclWork(int rank, c10d::OpType type, std::string what, c10::Device device,
           std::vector<at::Tensor> keep, std::vector<at::Tensor> outputs, bool cpu_sync,
           std::shared_ptr<std::atomic<bool>> aborted)
      : c10d::Work(rank, type),
        what_(std::move(what)),
        device_(device),
        keep_(std::move(keep)),
        outputs_(std::move(outputs)),
        cpu_sync_(cpu_sync),
        aborted_(std::move(aborted)),
        start_(std::chrono::steady_clock::now()) {}

  Event& end() { return end_; }

  bool isCompleted() override {
    checkAborted();
    return end_.query();
  }
  bool isSuccess() const override { return !aborted_->load(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds) override {
    checkAborted();
    c10::cuda::CUDAGuard g(device_);
    end_.block(c10::cuda::getCurrentCUDAStream(device_.index()));  // GPU-side wait
    if (cpu_sync_) end_.synchronize();                            // barrier: CPU waits too
    checkAborted();
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  void setFuture(c10::intrusive_ptr<c10::ivalue::Future> f) { future_ = std::move(f); }

  // watchdog side
  bool done() { return end_.query(); }
  double ageSeconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void release() { keep_.clear(); }
  const std::string& what() const { return what_; }

 private:
  void checkAborted() const {
    TORCH_CHECK(!aborted_->load(), "bytescale ", what_,
                ": the NCCL communicator was aborted (timeout or asynchronous NCCL error; see the "
                "watchdog message on stderr)");
  }
  std::string what_;
  c10::Device device_;
  std::vector<at::Tensor> keep_, outputs_;
  bool cpu_sync_;
  std::shared_ptr<std::atomic<bool>> aborted_;
  Event end_;
  std::chrono::steady_clock::time_point start_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class NcclExchange final : public comm::PendingExchange {
 public:
  NcclExchange(c10::Device d, std::shared_ptr<Event> ev) : device_(d), ev_(std::move(ev)) {}
  void wait() override {
    c10::cuda::CUDAGuard g(device_);
    ev_->block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }

 private:
  c10::Device device_;
  std::shared_ptr<Event> ev_;
};

class NcclBackend final : public c10d::Backend {
 public:
  NcclBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
              std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), store_(std::move(store)), timeout_(timeout),
        aborted_(std::make_shared<std::atomic<bool>>(false)) {
    watchdog_ = std::thread([this] { watchdogLoop(); });
  }
  ~NcclBackend() override {
    try {
      shutdown();
    } catch (...) {
    }
  }
  const std::string getBackendName() const override { return "bytescale-nccl"; }

  // ---- communicator --------------------------------------------------------------------------
  void connect(c10::DeviceIndex dev) {
    std::lock_guard<std::mutex> g(comm_mu_);
    if (comm_) {
      TORCH_CHECK(dev == device_.index(), "bytescale: the NCCL communicator lives on cuda:",
                  static_cast<int>(device_.index()), " but a tensor is on cuda:", static_cast<int>(dev));
      return;
    }
    device_ = c10::Device(c10::DeviceType::CUDA, dev);
    c10::cuda::CUDAGuard guard(device_);
    ncclUniqueId id;
    const std::string key = "bytescale/nccl_uid";
    if (getRank() == 0) {
      BYTESCALE_NCCL(ncclGetUniqueId(&id), "communicator init");
      std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id));
      store_->set(key, bytes);
    } else {
      store_->wait({key}, timeout_);
      auto bytes = store_->get(key);
      TORCH_CHECK(bytes.size() == sizeof(id), "bytescale: bad NCCL unique id in the store");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    BYTESCALE_NCCL(ncclCommInitRank(&comm_, getSize(), id, getRank()), "communicator init");
    stream_ = std::make_unique<c10::cuda::CUDAStream>(c10::cuda::getStreamFromPool(true, dev));
  }

  ncclComm_t requireComm(const std::string& what) {
    std::lock_guard<std::mutex> g(comm_mu_);
    TORCH_CHECK(comm_, "bytescale ", what, ": the NCCL communicator does not exist yet; pass "
                "device_id= to init_process_group or run a world collective first (creating it from "
                "a subset of ranks would deadlock)");
    TORCH_CHECK(!aborted_->load(), "bytescale ", what, ": the NCCL communicator was aborted");
    return comm_;
  }

  c10::Device device() const { return device_; }
  c10::cuda::CUDAStream& stream() { return *stream_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Enqueue fn(comm, stream) on the comm stream after the caller's current stream; returns Work.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> launch(const std::string& what, c10d::OpType type,
                                        const std::vector<at::Tensor>& inputs,
                                        std::vector<at::Tensor> outputs, bool world, F fn,
                                        bool cpu_sync = false) {
    TORCH_CHECK(!shut_down_, "bytescale ", what, ": the backend has been shut down");
    if (world && !inputs.empty())
      connect(inputs[0].device().index());
    else if (world && !outputs.empty())  // e.g. scatter on a non-root rank: no inputs
      connect(outputs[0].device().index());
    ncclComm_t comm = requireComm(what);
    const auto dev = device_;
    c10::cuda::CUDAGuard guard(dev);
    auto caller = c10::cuda::getCurrentCUDAStream(dev.index());
    Event start;
    start.record(caller);
    start.block(*stream_);
    std::vector<at::Tensor> keep = inputs;
    keep.insert(keep.end(), outputs.begin(), outputs.end());
    auto work = c10::make_intrusive<NcclWork>(getRank(), type, what, dev, keep, outputs, cpu_sync,
                                              aborted_);
    {
      c10::cuda::CUDAStreamGuard sg(*stream_);
      fn(comm, stream_->stream());
      for (const auto& t : keep)
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *stream_);
      work->end().record(*stream_);
      // A CUDA-aware future completed on the comm stream (DDP's comm hook reads its value).
      auto fut = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{dev});
      fut->markCompleted(c10::IValue(outputs));
      work->setFuture(fut);
    }
    track(work);
    return work;
  }

  std::unique_ptr<comm::PendingExchange> exchange(const std::vector<comm::P2POp>& ops,
                                                  const std::string& what) {
    ncclComm_t comm = requireComm(what);
    const auto dev = device_;
    c10::cuda::CUDAGuard guard(dev);
    auto caller = c10::cuda::getCurrentCUDAStream(dev.index());
    Event start;
    start.record(caller);
    start.block(*stream_);
    auto end = std::make_shared<Event>();
    GroupGuard group_(what.c_str());
    for (const auto& op : ops) {
      TORCH_CHECK(op.tensor.is_cuda() && op.tensor.device() == dev, "bytescale ", what,
                  ": point-to-point tensor on ", op.tensor.device(), ", communicator on ", dev);
      TORCH_CHECK(op.tensor.is_contiguous(), "bytescale ", what, ": tensors must be contiguous");
      TORCH_CHECK(op.peer >= 0 && op.peer < getSize() && op.peer != getRank(), "bytescale ", what,
                  ": bad peer rank ", op.peer);
      if (op.tensor.numel() == 0) continue;
      auto dt = ncclType(op.tensor.scalar_type(), what);
      if (op.kind == comm::P2POp::kSend)
        BYTESCALE_NCCL(ncclSend(op.tensor.data_ptr(), op.tensor.numel(), dt, op.peer, comm, stream_->stream()), what);
      else
        BYTESCALE_NCCL(ncclRecv(op.tensor.data_ptr(), op.tensor.numel(), dt, op.peer, comm, stream_->stream()), what);
      c10::cuda::CUDACachingAllocator::recordStream(op.tensor.storage().data_ptr(), *stream_);
    }
    group_.end();
    end->record(*stream_);
    return std::make_unique<NcclExchange>(dev, end);
  }

  // ---- collectives ---------------------------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts,
                                           const c10d::AllreduceOptions& o) override {
    checkCuda(ts, "all_reduce");
    auto op = o.reduceOp;
    return launch("all_reduce", c10d::OpType::ALLREDUCE, ts, ts, true, [&](ncclComm_t c, cudaStream_t s) {
      GroupGuard group_("all_reduce");
      std::vector<RedOp> created;
      for (auto& t : ts) {
        RedOp r = ncclOp(op, t, c, "all_reduce");
        BYTESCALE_NCCL(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                     ncclType(t.scalar_type(), "all_reduce"), r.op, c, s), "all_reduce");
        if (r.created) created.push_back(r);
      }
      group_.end();
      for (auto& r : created) ncclRedOpDestroy(r.op, c);
    });
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    return allreduce(ts, o);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts,
                                           const c10d::BroadcastOptions& o) override {
    checkCuda(ts, "broadcast");
    int root = static_cast<int>(o.rootRank);
    return launch("broadcast", c10d::OpType::BROADCAST, ts, ts, true, [&](ncclComm_t c, cudaStream_t s) {
      GroupGuard group_("broadcast");
      for (auto& t : ts)
        BYTESCALE_NCCL(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(),
                                     ncclType(t.scalar_type(), "broadcast"), root, c, s), "broadcast");
      group_.end();
    });
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& ts,
                                        const c10d::ReduceOptions& o) override {
    checkCuda(ts, "reduce");
    int root = static_cast<int>(o.rootRank);
    auto op = o.reduceOp;
    return launch("reduce", c10d::OpType::REDUCE, ts, ts, true, [&](ncclComm_t c, cudaStream_t s) {
      for (auto& t : ts) {
        RedOp r = ncclOp(op, t, c, "reduce");
        BYTESCALE_NCCL(ncclReduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                  ncclType(t.scalar_type(), "reduce"), r.op, root, c, s), "reduce");
        if (r.created) ncclRedOpDestroy(r.op, c);
      }
    });
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    checkCuda({out, in}, "all_gather_into_tensor");
    TORCH_CHECK(out.scalar_type() == in.scalar_type(), "bytescale all_gather_into_tensor: dtype ",
                in.scalar_type(), " in, ", out.scalar_type(), " out");
    TORCH_CHECK(out.numel() == in.numel() * getSize(), "bytescale all_gather_into_tensor: output has ",
                out.numel(), " elements, needs ", in.numel() * getSize());
    return launch("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {in}, {out}, true,
                  [&](ncclComm_t c, cudaStream_t s) {
                    BYTESCALE_NCCL(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(),
                                                 ncclType(in.scalar_type(), "all_gather"), c, s),
                                   "all_gather_into_tensor");
                  });
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outs,
                                           std::vector<at::Tensor>& ins,
                                           const c10d::AllgatherOptions&) override {
    checkCuda(ins, "all_gather");
    TORCH_CHECK(outs.size() == ins.size(), "bytescale all_gather: output lists != inputs");
    std::vector<at::Tensor> flat_outs;
    for (auto& l : outs) flat_outs.insert(flat_outs.end(), l.begin(), l.end());
    return launch("all_gather", c10d::OpType::ALLGATHER, ins, flat_outs, true, [&](ncclComm_t c, cudaStream_t s) {
      for (size_t k = 0; k < ins.size(); ++k) {
        TORCH_CHECK(static_cast<int>(outs[k].size()) == getSize(), "bytescale all_gather: ",
                    outs[k].size(), " outputs for world size ", getSize());
        at::Tensor buf = at::empty({getSize() * ins[k].numel()}, ins[k].options());
        BYTESCALE_NCCL(ncclAllGather(ins[k].data_ptr(), buf.data_ptr(), ins[k].numel(),
                                     ncclType(ins[k].scalar_type(), "all_gather"), c, s), "all_gather");
        auto parts = buf.view({getSize(), -1});
        for (int j = 0; j < getSize(); ++j) outs[k][j].copy_(parts[j].view(outs[k][j].sizes()));
      }
    });
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                                     std::vector<at::Tensor>& ins,
                                                     const c10d::AllgatherOptions& o) override {
    return allgather(outs, ins, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins, const c10d::AllgatherOptions&) override {
    checkCuda(ins, "all_gather_into_tensor_coalesced");
    TORCH_CHECK(outs.size() == ins.size(), "bytescale all_gather_into_tensor_coalesced: ", outs.size(),
                " outputs for ", ins.size(), " inputs");
    checkCuda(outs, "all_gather_into_tensor_coalesced");
    for (size_t k = 0; k < ins.size(); ++k)
      TORCH_CHECK(outs[k].scalar_type() == ins[k].scalar_type() && outs[k].numel() == ins[k].numel() * getSize(),
                  "bytescale all_gather_into_tensor_coalesced: tensor ", k, " has input ", ins[k].sizes(), " ",
                  ins[k].scalar_type(), " and output ", outs[k].sizes(), " ", outs[k].scalar_type());
    return launch("all_gather_into_tensor_coalesced", c10d::OpType::COALESCED, ins, outs, true,
                  [&](ncclComm_t c, cudaStream_t s) {
                    GroupGuard group_("all_gather_coalesced");
                    for (size_t k = 0; k < ins.size(); ++k)
                      BYTESCALE_NCCL(ncclAllGather(ins[k].data_ptr(), outs[k].data_ptr(), ins[k].numel(),
                                                   ncclType(ins[k].scalar_type(), "all_gather"), c, s),
                                     "all_gather_coalesced");
                    group_.end();
                  });
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    checkCuda({out, in}, "reduce_scatter_tensor");
    TORCH_CHECK(out.scalar_type() == in.scalar_type(), "bytescale reduce_scatter_tensor: dtype ",
                in.scalar_type(), " in, ", out.scalar_type(), " out");
    TORCH_CHECK(in.numel() == out.numel() * getSize(), "bytescale reduce_scatter_tensor: input has ",
                in.numel(), " elements, needs ", out.numel() * getSize());
    auto op = o.reduceOp;
    return launch("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {in}, {out}, true,
                  [&](ncclComm_t c, cudaStream_t s) {
                    RedOp r = ncclOp(op, in, c, "reduce_scatter");
                    BYTESCALE_NCCL(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(),
                                                     ncclType(in.scalar_type(), "reduce_scatter"), r.op, c, s),
                                   "reduce_scatter_tensor");
                    if (r.created) ncclRedOpDestroy(r.op, c);
                  });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::ReduceScatterOptions& o) override {
    checkCuda(ins, "reduce_scatter_tensor_coalesced");
    TORCH_CHECK(outs.size() == ins.size(), "bytescale reduce_scatter_tensor_coalesced: ", outs.size(),
                " outputs for ", ins.size(), " inputs");
    checkCuda(outs, "reduce_scatter_tensor_coalesced");
    for (size_t k = 0; k < ins.size(); ++k)
      TORCH_CHECK(outs[k].scalar_type() == ins[k].scalar_type() && outs[k].numel() * getSize() == ins[k].numel(),
                  "bytescale reduce_scatter_tensor_coalesced: tensor ", k, " has input ", ins[k].sizes(), " ",
                  ins[k].scalar_type(), " and output ", outs[k].sizes(), " ", outs[k].scalar_type());
    auto op = o.reduceOp;
    return launch("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, ins, outs, true,
                  [&](ncclComm_t c, cudaStream_t s) {
                    std::vector<RedOp> created;
                    GroupGuard group_("reduce_scatter_coalesced");
                    for (size_t k = 0; k < ins.size(); ++k) {
                      RedOp r = ncclOp(op, ins[k], c, "reduce_scatter");
                      BYTESCALE_NCCL(ncclReduceScatter(ins[k].data_ptr(), outs[k].data_ptr(), outs[k].numel(),
                                                       ncclType(ins[k].scalar_type(), "reduce_scatter"), r.op, c, s),
                                     "reduce_scatter_coalesced");
                      if (r.created) created.push_back(r);
                    }
                    group_.end();
                    for (auto& r : created) ncclRedOpDestroy(r.op, c);
                  });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outs,
                                                std::vector<std::vector<at::Tensor>>& ins,
                                                const c10d::ReduceScatterOptions& o) override {
    TORCH_CHECK(outs.size() == 1 && ins.size() == 1, "bytescale reduce_scatter: one output and one input list");
    checkCuda(outs, "reduce_scatter");
    std::vector<at::Tensor> flat;
    for (auto& t : ins[0]) flat.push_back(t.reshape(-1));
    at::Tensor in = at::cat(flat);
    return _reduce_scatter_base(outs[0], in, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions&) override {
    checkCuda({out, in}, "all_to_all_single");
    const int n = getSize();
    auto fill = [&](std::vector<int64_t>& sp, const at::Tensor& t) {
      if (sp.empty()) {
        TORCH_CHECK(t.size(0) % n == 0, "bytescale all_to_all_single: dim 0 (", t.size(0),
                    ") not divisible by world size ", n);
        sp.assign(n, t.size(0) / n);
      }
      TORCH_CHECK(static_cast<int>(sp.size()) == n, "bytescale all_to_all_single: ", sp.size(),
                  " splits for world size ", n);
    };
    fill(in_splits, in);
    fill(out_splits, out);
    TORCH_CHECK(in.scalar_type() == out.scalar_type(), "bytescale all_to_all_single: dtype ",
                in.scalar_type(), " in, ", out.scalar_type(), " out");
    int64_t si = 0, so = 0;
    for (int j = 0; j < n; ++j) {
      TORCH_CHECK(in_splits[j] >= 0 && out_splits[j] >= 0, "bytescale all_to_all_single: negative split");
      si += in_splits[j];
      so += out_splits[j];
    }
    TORCH_CHECK(si == in.size(0) && so == out.size(0), "bytescale all_to_all_single: splits sum to ",
                si, " and ", so, " but dim 0 is ", in.size(0), " and ", out.size(0));
    return launch("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {in}, {out}, true,
                  [&](ncclComm_t c, cudaStream_t s) {
                    const int64_t row_in = in.numel() / std::max<int64_t>(1, in.size(0));
                    const int64_t row_out = out.numel() / std::max<int64_t>(1, out.size(0));
                    auto dt = ncclType(in.scalar_type(), "all_to_all");
                    const int64_t es = in.element_size();
                    int64_t io = 0, oo = 0;
                    GroupGuard group_("all_to_all_single");
                    for (int j = 0; j < n; ++j) {
                      if (in_splits[j])
                        BYTESCALE_NCCL(ncclSend(static_cast<char*>(in.data_ptr()) + io * row_in * es,
                                                in_splits[j] * row_in, dt, j, c, s), "all_to_all_single");
                      if (out_splits[j])
                        BYTESCALE_NCCL(ncclRecv(static_cast<char*>(out.data_ptr()) + oo * row_out * es,
                                                out_splits[j] * row_out, dt, j, c, s), "all_to_all_single");
                      io += in_splits[j];
                      oo += out_splits[j];
                    }
                    group_.end();
                  });
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                          const c10d::AllToAllOptions&) override {
    checkCuda(ins, "all_to_all");
    TORCH_CHECK(static_cast<int>(outs.size()) == getSize() && static_cast<int>(ins.size()) == getSize(),
                "bytescale all_to_all: needs ", getSize(), " inputs and outputs");
    return launch("all_to_all", c10d::OpType::ALLTOALL, ins, outs, true, [&](ncclComm_t c, cudaStream_t s) {
      GroupGuard group_("all_to_all");
      for (int j = 0; j < getSize(); ++j) {
        BYTESCALE_NCCL(ncclSend(ins[j].data_ptr(), ins[j].numel(), ncclType(ins[j].scalar_type(), "all_to_all"), j, c, s), "all_to_all");
        BYTESCALE_NCCL(ncclRecv(outs[j].data_ptr(), outs[j].numel(), ncclType(outs[j].scalar_type(), "all_to_all"), j, c, s), "all_to_all");
      }
      group_.end();
    });
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outs,
                                        std::vector<at::Tensor>& ins, const c10d::GatherOptions& o) override {
    checkCuda(ins, "gather");
    const int root = static_cast<int>(o.rootRank);
    std::vector<at::Tensor> flat;
    if (getRank() == root) {
      TORCH_CHECK(outs.size() == 1 && static_cast<int>(outs[0].size()) == getSize(),
                  "bytescale gather: root needs ", getSize(), " outputs");
      flat = outs[0];
    }
    return launch("gather", c10d::OpType::GATHER, ins, flat, true, [&](ncclComm_t c, cudaStream_t s) {
      auto dt = ncclType(ins[0].scalar_type(), "gather");
      GroupGuard group_("gather");
      if (getRank() == root) {
        for (int j = 0; j < getSize(); ++j) {
          if (j == root) continue;
          BYTESCALE_NCCL(ncclRecv(flat[j].data_ptr(), flat[j].numel(), dt, j, c, s), "gather");
        }
      } else {
        BYTESCALE_NCCL(ncclSend(ins[0].data_ptr(), ins[0].numel(), dt, root, c, s), "gather");
      }
      group_.end();
      if (getRank() == root) flat[root].copy_(ins[0].view(flat[root].sizes()));
    });
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outs,
                                         std::vector<std::vector<at::Tensor>>& ins,
                                         const c10d::ScatterOptions& o) override {
    checkCuda(outs, "scatter");
    const int root = static_cast<int>(o.rootRank);
    std::vector<at::Tensor> src;
    if (getRank() == root) {
      TORCH_CHECK(ins.size() == 1 && static_cast<int>(ins[0].size()) == getSize(),
                  "bytescale scatter: root needs ", getSize(), " inputs");
      src = ins[0];
    }
    return launch("scatter", c10d::OpType::SCATTER, src, outs, true, [&](ncclComm_t c, cudaStream_t s) {
      auto dt = ncclType(outs[0].scalar_type(), "scatter");
      GroupGuard group_("scatter");
      if (getRank() == root) {
        for (int j = 0; j < getSize(); ++j)
          if (j != root) BYTESCALE_NCCL(ncclSend(src[j].data_ptr(), src[j].numel(), dt, j, c, s), "scatter");
      } else {
        BYTESCALE_NCCL(ncclRecv(outs[0].data_ptr(), outs[0].numel(), dt, root, c, s), "scatter");
      }
      group_.end();
      if (getRank() == root) outs[0].copy_(src[root].view(outs[0].sizes()));
    });
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& ts, int dst, int) override {
    checkCuda(ts, "send");
    return p2p(comm::P2POp::kSend, ts[0], dst, "send");
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& ts, int src, int) override {
    checkCuda(ts, "recv");
    return p2p(comm::P2POp::kRecv, ts[0], src, "recv");
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    requireComm("barrier on CUDA");
    c10::cuda::CUDAGuard g(device_);
    at::Tensor t = at::zeros({1}, at::TensorOptions().device(device_).dtype(at::kFloat));
    std::vector<at::Tensor> ts{t};
    return launch("barrier", c10d::OpType::BARRIER, ts, ts, true, [&](ncclComm_t c, cudaStream_t s) {
      BYTESCALE_NCCL(ncclAllReduce(t.data_ptr(), t.data_ptr(), 1, ncclFloat32, ncclSum, c, s), "barrier");
    }, /*cpu_sync=*/true);
  }

  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override {
    std::lock_guard<std::mutex> g(coalesce_mu_);
    TORCH_CHECK(!coalescing_, "bytescale: startCoalescing twice");
    coalescing_ = true;
    coalesced_.clear();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    std::vector<comm::P2POp> ops;
    {
      std::lock_guard<std::mutex> g(coalesce_mu_);
      TORCH_CHECK(coalescing_, "bytescale: endCoalescing without startCoalescing");
      coalescing_ = false;
      ops.swap(coalesced_);
    }
    std::vector<at::Tensor> ts;
    for (auto& op : ops) ts.push_back(op.tensor);
    return launch("batch_isend_irecv", c10d::OpType::COALESCED, ts, ts, false,
                  [&](ncclComm_t c, cudaStream_t s) {
                    GroupGuard group_("batch_isend_irecv");
                    for (auto& op : ops) {
                      if (op.tensor.numel() == 0) continue;
                      auto dt = ncclType(op.tensor.scalar_type(), "batch_isend_irecv");
                      if (op.kind == comm::P2POp::kSend)
                        BYTESCALE_NCCL(ncclSend(op.tensor.data_ptr(), op.tensor.numel(), dt, op.peer, c, s), "batch_isend_irecv");
                      else
                        BYTESCALE_NCCL(ncclRecv(op.tensor.data_ptr(), op.tensor.numel(), dt, op.peer, c, s), "batch_isend_irecv");
                    }
                    group_.end();
                  });
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> g(wd_mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    wd_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    std::lock_guard<std::mutex> g(comm_mu_);
    if (comm_) {
      if (aborted_->load())
        ncclCommAbort(comm_);
      else
        ncclCommDestroy(comm_);
      comm_ = nullptr;
    }
  }
  void abort() override {
    aborted_->store(true);
    ncclComm_t comm = nullptr;
    {
      std::lock_guard<std::mutex> g(comm_mu_);
      std::swap(comm, comm_);
    }
    if (comm) ncclCommAbort(comm);
  }

 private:
  c10::intrusive_ptr<c10d::Work> p2p(comm::P2POp::Kind kind, const at::Tensor& t, int peer, const char* what) {
    {
      std::lock_guard<std::mutex> g(coalesce_mu_);
      if (coalescing_) {
        coalesced_.push_back({kind, peer, t});
        auto w = c10::make_intrusive<c10d::Work>(getRank(), c10d::OpType::UNKNOWN);
        return w;  // the coalesced work returned by endCoalescing is the one to wait on
      }
    }
    std::vector<at::Tensor> ts{t};
    return launch(what, kind == comm::P2POp::kSend ? c10d::OpType::SEND : c10d::OpType::RECV, ts, ts,
                  false, [&](ncclComm_t c, cudaStream_t s) {
                    if (t.numel() == 0) return;
                    auto dt = ncclType(t.scalar_type(), what);
                    if (kind == comm::P2POp::kSend)
                      BYTESCALE_NCCL(ncclSend(t.data_ptr(), t.numel(), dt, peer, c, s), what);
                    else
                      BYTESCALE_NCCL(ncclRecv(t.data_ptr(), t.numel(), dt, peer, c, s), what);
                  });
  }

  void track(const c10::intrusive_ptr<NcclWork>& w) {
    std::lock_guard<std::mutex> g(wd_mu_);
    pending_.push_back(w);
  }

  // Releases finished works' tensors; aborts the communicator on timeout or async NCCL error.
  void watchdogLoop() {
    for (;;) {
      std::deque<c10::intrusive_ptr<NcclWork>> batch;
      {
        std::unique_lock<std::mutex> lk(wd_mu_);
        wd_cv_.wait_for(lk, std::chrono::milliseconds(100));
        if (shut_down_) return;
        batch.swap(pending_);
      }
      // Outside wd_mu_: releasing tensors may need the GIL, which a tracking thread may hold.
      std::deque<c10::intrusive_ptr<NcclWork>> still;
      std::string failed;
      for (auto& w : batch) {
        bool done = false;
        try {
          done = w->done();
        } catch (...) {
          done = true;
        }
        if (done) {
          w->release();
        } else {
          if (failed.empty() && w->ageSeconds() * 1000.0 > static_cast<double>(timeout_.count()))
            failed = w->what() + " timed out after " + std::to_string(timeout_.count()) + " ms";
          still.push_back(w);
        }
      }
      batch.clear();
      {
        std::lock_guard<std::mutex> g(wd_mu_);
        for (auto& w : still) pending_.push_front(w);
      }
      if (failed.empty()) {
        std::lock_guard<std::mutex> g(comm_mu_);
        ncclResult_t async = ncclSuccess;
        if (comm_ && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess)
          failed = std::string("asynchronous NCCL error: ") + ncclGetErrorString(async);
      }
      if (!failed.empty() && !aborted_->exchange(true)) {
        fprintf(stderr, "[bytescale watchdog] rank %d: %s; aborting the NCCL communicator\n",
                getRank(), failed.c_str());
        ncclComm_t comm = nullptr;
        {
          std::lock_guard<std::mutex> g(comm_mu_);
          std::swap(comm, comm_);
        }
        if (comm) ncclCommAbort(comm);
      }
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<std::atomic<bool>> aborted_;
  std::mutex comm_mu_;
  ncclComm_t comm_ = nullptr;
  c10::Device device_{c10::DeviceType::CUDA, 0};
  std::unique_ptr<c10::cuda::CUDAStream> stream_;
  std::mutex coalesce_mu_;
  bool coalescing_ = false;
  std::vector<comm::P2POp> coalesced_;
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  std::deque<c10::intrusive_ptr<NcclWork>> pending_;
  bool shut_down_ = false;
  std::thread watchdog_;
};

class NcclTransport final : public comm::Transport {
 public:
  explicit NcclTransport(c10::intrusive_ptr<NcclBackend> b) : b_(std::move(b)) {}
  c10::DeviceType deviceType() const override { return c10::DeviceType::CUDA; }
  int rank() const override { return b_->getRank(); }
  int worldSize() const override { return b_->getSize(); }
  std::chrono::milliseconds timeout() const override { return b_->timeout(); }
  std::unique_ptr<comm::PendingExchange> exchange(const std::vector<comm::P2POp>& ops,
                                                  const std::string& what) override {
    return b_->exchange(ops, what);
  }
  c10::intrusive_ptr<c10d::Work> run(const std::string& what, std::vector<at::Tensor> outputs,
                                     std::function<void()> body) override {
    // A world of one has no peer to deadlock with: create the communicator on first use. With
    // more ranks it must come from a world collective (or device_id=), run by every rank.
    if (b_->getSize() == 1 && !outputs.empty() && outputs[0].is_cuda())
      b_->connect(outputs[0].device().index());
    std::vector<at::Tensor> none;
    return b_->launch(what, c10d::OpType::UNKNOWN, none, std::move(outputs), false,
                      [&](ncclComm_t, cudaStream_t) { body(); });
  }

 private:
  c10::intrusive_ptr<NcclBackend> b_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> makeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size,
                                                  std::chrono::milliseconds timeout) {
  return c10::make_intrusive<NcclBackend>(store, rank, size, timeout);
}

std::shared_ptr<comm::Transport> transportOf(const c10::intrusive_ptr<c10d::Backend>& nccl) {
  auto b = c10::dynamic_intrusive_pointer_cast<NcclBackend>(nccl);
  TORCH_CHECK(b, "bytescale: not an NCCL backend");
  return std::make_shared<NcclTransport>(b);
}

void eagerConnect(const c10::intrusive_ptr<c10d::Backend>& nccl, c10::DeviceIndex device) {
  auto b = c10::dynamic_intrusive_pointer_cast<NcclBackend>(nccl);
  TORCH_CHECK(b, "bytescale: not an NCCL backend");
  b->connect(device < 0 ? static_cast<c10::DeviceIndex>(0) : device);
}

}  // namespace cuda
}  // namespace bytescale
