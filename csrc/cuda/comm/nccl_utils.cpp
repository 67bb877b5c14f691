#include "cuda/comm/nccl_utils.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <condition_variable>
#include <cstring>
#include <functional>
#include <utility>
#include <thread>

namespace bytescale {
namespace cuda {

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

namespace {
thread_local int64_t t_nccl_calls = 0;
}  // namespace

int64_t ncclCallsOnThisThread() { return t_nccl_calls; }

void checkNcclDtypes(const std::vector<at::Tensor>& ts, const std::string& what) {
  for (const auto& t : ts)
    if (t.defined()) (void)ncclType(t.scalar_type(), what);
}

void checkNcclReduceOp(const c10d::ReduceOp& op, const at::Tensor& t, const std::string& what) {
  (void)ncclType(t.scalar_type(), what);
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::AVG:
      return;
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(sup, "bytescale ", what, ": PREMUL_SUM without a factor");
      TORCH_CHECK(!sup->tensor_factor.defined() || sup->tensor_factor.numel() == 1, "bytescale ",
                  what, ": PREMUL_SUM factor must be a scalar");
      return;
    }
    default:
      TORCH_CHECK(false, "bytescale ", what, ": reduce op ", static_cast<int>(op.op_),
                  " (bitwise) is not supported by NCCL");
  }
}

NcclRedOp::NcclRedOp(const c10d::ReduceOp& op, const at::Tensor& t, ncclComm_t comm,
                     const std::string& what) {
  const bool is_bool = t.scalar_type() == at::kBool;  // uint8 on the wire: SUM = OR, PRODUCT = AND
  switch (op.op_) {
    case c10d::ReduceOp::SUM: op_ = is_bool ? ncclMax : ncclSum; return;
    case c10d::ReduceOp::PRODUCT: op_ = is_bool ? ncclMin : ncclProd; return;
    case c10d::ReduceOp::MIN: op_ = ncclMin; return;
    case c10d::ReduceOp::MAX: op_ = ncclMax; return;
    case c10d::ReduceOp::AVG: op_ = ncclAvg; return;  // floating dtype checked by validate()
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(sup, "bytescale ", what, ": PREMUL_SUM without a factor");
      TORCH_CHECK(!sup->tensor_factor.defined() || sup->tensor_factor.numel() == 1, "bytescale ",
                  what, ": PREMUL_SUM factor must be a scalar");
      double f = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>()
                                              : sup->double_factor;
      ncclDataType_t dt = ncclType(t.scalar_type(), what);
      float ff = static_cast<float>(f);
      at::Half hf = static_cast<at::Half>(f);
      at::BFloat16 bf = static_cast<at::BFloat16>(f);
      void* scalar = t.scalar_type() == at::kDouble     ? static_cast<void*>(&f)
                     : t.scalar_type() == at::kHalf     ? static_cast<void*>(&hf)
                     : t.scalar_type() == at::kBFloat16 ? static_cast<void*>(&bf)
                                                        : static_cast<void*>(&ff);
      BYTESCALE_NCCL_CHECK(ncclRedOpCreatePreMulSum(&op_, scalar, dt, ncclScalarHostImmediate, comm),
                           what);
      comm_ = comm;
      return;
    }
    default:
      TORCH_CHECK(false, "bytescale ", what, ": reduce op ", static_cast<int>(op.op_),
                  " (bitwise) is not supported by NCCL");
  }
}

NcclRedOp::~NcclRedOp() {
  if (comm_) (void)ncclRedOpDestroy(op_, comm_);
}

NcclGroup::NcclGroup(std::string what) : what_(std::move(what)) {
  ++t_nccl_calls;
  BYTESCALE_NCCL_CHECK(ncclGroupStart(), what_);
  open_ = true;
}

void NcclGroup::end() {
  open_ = false;
  BYTESCALE_NCCL_CHECK(ncclGroupEnd(), what_);
}

NcclGroup::~NcclGroup() {
  if (open_) (void)ncclGroupEnd();
}

void checkNcclTensors(const std::vector<at::Tensor>& ts, c10::Device device,
                      const std::string& what) {
  for (const auto& t : ts) {
    TORCH_CHECK(t.is_cuda() && t.device() == device, "bytescale ", what, ": tensor on ",
                t.device(), " but the NCCL communicator lives on ", device);
    TORCH_CHECK(t.is_contiguous(), "bytescale ", what, ": NCCL needs contiguous tensors (shape ",
                t.sizes(), ")");
  }
}

void ncclSendTensor(const at::Tensor& t, int peer, ncclComm_t comm, cudaStream_t s,
                    const std::string& what) {
  if (t.numel() == 0) return;
  ++t_nccl_calls;
  BYTESCALE_NCCL_CHECK(
      ncclSend(t.data_ptr(), t.numel(), ncclType(t.scalar_type(), what), peer, comm, s), what);
}

void ncclRecvTensor(const at::Tensor& t, int peer, ncclComm_t comm, cudaStream_t s,
                    const std::string& what) {
  if (t.numel() == 0) return;
  ++t_nccl_calls;
  BYTESCALE_NCCL_CHECK(
      ncclRecv(t.data_ptr(), t.numel(), ncclType(t.scalar_type(), what), peer, comm, s), what);
}

// ---- NcclComm ---------------------------------------------------------------------------------

NcclComm::NcclComm(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout)
    : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout) {}

NcclComm::~NcclComm() { destroy(); }

namespace {

// Creates a communicator (ncclCommInitRank, ncclCommSplit: both wait for every rank involved) on
// a thread of its own, so the caller can stop waiting after the group's timeout and raise
// `late` instead of blocking forever. A communicator that arrives after the caller gave up is
// aborted by that thread.
struct PendingInit {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool abandoned = false;
  ncclComm_t comm = nullptr;
  ncclResult_t result = ncclSuccess;
  std::string last_error;
};

using Create = std::function<ncclResult_t(ncclComm_t*)>;

// Returns NCCL's result and the communicator (`error`: NCCL's last error text); raises
// DistBackendError starting with `late` past `timeout`.
std::pair<ncclResult_t, ncclComm_t> createBounded(Create create, c10::DeviceIndex dev,
                                                  std::chrono::milliseconds timeout,
                                                  const std::string& late, std::string* error) {
  auto st = std::make_shared<PendingInit>();
  std::thread([st, create = std::move(create), dev] {
    ncclComm_t c = nullptr;
    ncclResult_t r = ncclInternalError;
    std::string err;
    try {
      const c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, dev));
      r = create(&c);
      if (r != ncclSuccess) err = ncclGetLastError(nullptr);
    } catch (const std::exception& e) {
      err = e.what();
    }
    std::lock_guard<std::mutex> g(st->mu);
    if (st->abandoned) {
      if (r == ncclSuccess && c) (void)ncclCommAbort(c);
      return;
    }
    st->comm = c;
    st->result = r;
    st->last_error = err;
    st->done = true;
    st->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lk(st->mu);
  const bool finished = timeout <= std::chrono::milliseconds(0)
                            ? (st->cv.wait(lk, [&] { return st->done; }), true)
                            : st->cv.wait_for(lk, timeout, [&] { return st->done; });
  if (!finished) {
    st->abandoned = true;
    TORCH_CHECK_WITH(DistBackendError, false, late, " did not complete within ", timeout.count(),
                     " ms (the process group's timeout)");
  }
  *error = st->last_error;
  return {st->result, st->comm};
}

ncclComm_t initRankBounded(int size, const ncclUniqueId& id, int rank, c10::DeviceIndex dev,
                           std::chrono::milliseconds timeout) {
  std::string err;
  auto [result, comm] = createBounded(
      [size, id, rank](ncclComm_t* c) { return ncclCommInitRank(c, size, id, rank); }, dev,
      timeout,
      "bytescale: creating the NCCL communicator on cuda:" + std::to_string(dev) + " (rank " +
          std::to_string(rank) + " of " + std::to_string(size) +
          ") waits for every rank (of the world: device_id= or the first world collective on a "
          "CUDA tensor; of a static group: its first collective, or point-to-point op for a "
          "group of two) and",
      &err);
  if (result != ncclSuccess) {
    std::string hint;
    if (result == ncclInvalidUsage)
      hint = " (NCCL refuses two ranks on one GPU: give each rank its own GPU, "
             "device_id=torch.device(\"cuda\", local_rank); for several processes on one GPU use "
             "the staged transport, BYTESCALE_CUDA_TRANSPORT=staged, a development tool)";
    TORCH_CHECK_WITH(DistBackendError, false, "bytescale communicator init: NCCL error in "
                     "ncclCommInitRank on cuda:", static_cast<int>(dev), " (rank ", rank, " of ",
                     size, "): ", ncclGetErrorString(result),
                     err.empty() ? std::string() : " (" + err + ")", hint);
  }
  return comm;
}

// A communication stream of the communicator's own (not one of the pool's 32, which two live
// communicators could draw alike: one's waits would then hold the other's ops, the shared-channel
// deadlock); destroyed with the communicator.
c10::cuda::CUDAStream ownStream(c10::DeviceIndex dev) {
  const c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, dev));
  int least = 0, greatest = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
  return c10::cuda::getStreamFromExternal(s, dev);
}

}  // namespace

void NcclComm::connect(c10::DeviceIndex dev) {
  std::lock_guard<std::mutex> g(mu_);
  if (comm_ || aborted_) {
    TORCH_CHECK(dev == device_.index(), "bytescale: the NCCL communicator lives on cuda:",
                static_cast<int>(device_.index()), " but a tensor is on cuda:",
                static_cast<int>(dev));
    return;
  }
  device_ = c10::Device(c10::DeviceType::CUDA, dev);
  c10::cuda::CUDAGuard guard(device_);
  ncclUniqueId id;
  // A key per creation: every rank counts the creations on this store (all ranks create each
  // communicator once), so a job re-initialised on the same store reads the new id, not a stale
  // one (a stale id would make ncclCommInitRank wait forever).
  const int64_t count = store_->add("bytescale/nccl_connects", 1);
  const std::string key = "bytescale/nccl_uid/" + std::to_string((count - 1) / size_);
  if (rank_ == 0) {
    BYTESCALE_NCCL_CHECK(ncclGetUniqueId(&id), "communicator init");
    std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id),
                               reinterpret_cast<uint8_t*>(&id) + sizeof(id));
    store_->set(key, bytes);
  } else {
    store_->wait({key}, timeout_);
    auto bytes = store_->get(key);
    TORCH_CHECK(bytes.size() == sizeof(id), "bytescale: bad NCCL unique id in the store");
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  comm_ = initRankBounded(size_, id, rank_, dev, timeout_);
  stream_ = ownStream(dev);
}

std::shared_ptr<NcclComm> NcclComm::split(int color, int key,
                                          c10::intrusive_ptr<c10d::Store> store, int rank,
                                          int size, std::chrono::milliseconds timeout) {
  ncclComm_t parent = require("communicator split");
  const c10::Device dev = device();
  c10::cuda::CUDAGuard guard(dev);
  // Bounded by the group's timeout: a rank of the parent that raised before its part of the
  // split (or died) would otherwise leave the others blocked forever (in init_mesh, new_group).
  // Past it the parent is aborted (a rank is missing: it cannot be trusted) and this raises.
  std::string err;
  std::pair<ncclResult_t, ncclComm_t> made{ncclSuccess, nullptr};
  try {
    made = createBounded(
        [parent, color, key](ncclComm_t* c) {
          ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
          return ncclCommSplit(parent, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, c, &config);
        },
        dev.index(), timeout,
        "bytescale communicator split (rank " + std::to_string(rank_) + " of " +
            std::to_string(size_) + " of the parent group): every rank of the parent must take "
            "part, the new group's members and the others alike; the split",
        &err);
  } catch (const c10::DistBackendError& e) {
    abort(std::string("a communicator split timed out: ") + e.what_without_backtrace());
    throw;
  }
  TORCH_CHECK_WITH(DistBackendError, made.first == ncclSuccess, "bytescale communicator split: "
                   "NCCL error in ncclCommSplit: ", ncclGetErrorString(made.first),
                   err.empty() ? std::string() : " (" + err + ")");
  ncclComm_t child = made.second;
  if (color < 0 || child == nullptr) return nullptr;
  auto out = std::make_shared<NcclComm>(std::move(store), rank, size, timeout);
  std::lock_guard<std::mutex> g(out->mu_);
  out->comm_ = child;
  out->device_ = dev;
  out->stream_ = ownStream(dev.index());
  return out;
}

bool NcclComm::connected() const {
  std::lock_guard<std::mutex> g(mu_);
  return comm_ != nullptr;
}

ncclComm_t NcclComm::require(const std::string& what) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK_WITH(DistBackendError, !aborted_, "bytescale ", what,
                   ": the NCCL communicator was aborted (", abort_reason_, ")");
  TORCH_CHECK(comm_, "bytescale ", what, ": the NCCL communicator of this group (", size_,
              " ranks) does not exist yet; pass device_id= to init_process_group (the world's is "
              "then created at once, and static groups' split from it) or run a collective on "
              "the group first, on every member (creating it from a subset of its ranks would "
              "deadlock; a group of two creates it on its first point-to-point op)");
  return comm_;
}

c10::Device NcclComm::device() const {
  std::lock_guard<std::mutex> g(mu_);
  return device_;
}

c10::cuda::CUDAStream NcclComm::stream() const {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(stream_, "bytescale: the NCCL communicator is not connected");
  return *stream_;
}

void NcclComm::abort(const std::string& reason) {
  ncclComm_t comm = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (aborted_.exchange(true)) return;
    abort_reason_ = reason;
    std::swap(comm, comm_);
  }
  if (comm) (void)ncclCommAbort(comm);
}

std::string NcclComm::abortReason() const {
  std::lock_guard<std::mutex> g(mu_);
  return abort_reason_;
}

std::optional<std::string> NcclComm::asyncError() {
  std::lock_guard<std::mutex> g(mu_);
  ncclResult_t async = ncclSuccess;
  if (comm_ && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess)
    return std::string("asynchronous NCCL error: ") + ncclGetErrorString(async);
  return std::nullopt;
}

void NcclComm::destroy() {
  ncclComm_t comm = nullptr;
  std::optional<c10::cuda::CUDAStream> stream;
  c10::Device dev(c10::DeviceType::CUDA, 0);
  {
    std::lock_guard<std::mutex> g(mu_);
    std::swap(comm, comm_);
    stream = stream_;
    dev = device_;
  }
  if (!comm) return;
  // Queued operations make ncclCommDestroy wait for them, and they may wait for peers that are
  // gone: give the communication stream a bounded time to drain, else abort.
  const auto limit = std::min<std::chrono::milliseconds>(
      timeout_ > std::chrono::milliseconds(0) ? timeout_ : std::chrono::milliseconds(10000),
      std::chrono::milliseconds(10000));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  bool idle = false;
  try {
    const c10::cuda::CUDAGuard guard(dev);
    for (;;) {
      cudaError_t e = stream ? cudaStreamQuery(stream->stream()) : cudaSuccess;
      if (e == cudaSuccess) {
        idle = true;
        break;
      }
      (void)cudaGetLastError();
      if (e != cudaErrorNotReady) return;  // the CUDA runtime is shutting down: leave it be
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (...) {
    return;
  }
  if (idle) {
    (void)ncclCommDestroy(comm);
    // The stream is this communicator's own (ownStream); idle, nothing is queued on it any more.
    if (stream) (void)cudaStreamDestroy(stream->stream());
  } else {
    (void)ncclCommAbort(comm);  // the stream may still be busy: left to the process's end
  }
}

}  // namespace cuda
}  // namespace bytescale
