#include "cuda/comm/nccl_transport.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common/handoff.h"

namespace bytescale {
namespace cuda {

namespace {

// A launched exchange: an NcclWork the watchdog tracks like any collective (a lost peer makes it
// time out and abort the communicator instead of hanging ring attention forever). wait() is the
// Work's GPU-side wait (the caller's current stream waits on its end event).
class NcclExchange final : public comm::PendingExchange {
 public:
  explicit NcclExchange(c10::intrusive_ptr<NcclWork> work) : work_(std::move(work)) {}
  void wait() override { work_->wait(); }

 private:
  c10::intrusive_ptr<NcclWork> work_;
};

// The comm stream waits for the work already queued on the caller's current stream.
void followCaller(c10::Device dev, const c10::cuda::CUDAStream& comm_stream) {
  CudaEvent start;
  start.record(c10::cuda::getCurrentCUDAStream(dev.index()));
  start.block(comm_stream);
}

void enqueueP2P(const std::vector<comm::P2POp>& ops, ncclComm_t comm, cudaStream_t s,
                const std::string& what) {
  for (const auto& op : ops) (void)ncclType(op.tensor.scalar_type(), what);  // before the group
  NcclGroup group(what);
  for (const auto& op : ops) {
    if (op.kind == comm::P2POp::kSend)
      ncclSendTensor(op.tensor, op.peer, comm, s, what);
    else
      ncclRecvTensor(op.tensor, op.peer, comm, s, what);
  }
  group.end();
}

// A communicator of two ranks (a pipeline channel's static group, Mesh.p2p_group) is created by
// its first point-to-point op: both of its ranks take part in any of them. A larger one needs a
// collective of every member first (NcclComm::require says so).
void connectForP2P(NcclComm& comm, int size, const std::vector<comm::P2POp>& ops) {
  if (size == 2 && !ops.empty() && ops[0].tensor.is_cuda())
    comm.connect(ops[0].tensor.device().index());
}

void checkPeers(const std::vector<comm::P2POp>& ops, int rank, int size, const std::string& what) {
  for (const auto& op : ops)
    TORCH_CHECK(op.peer >= 0 && op.peer < size && op.peer != rank, "bytescale ", what,
                ": peer rank ", op.peer, " is not another rank of the world of ", size);
}

std::vector<int> peersOf(const std::vector<comm::P2POp>& ops) {
  std::vector<int> peers;
  for (const auto& op : ops)
    if (std::find(peers.begin(), peers.end(), op.peer) == peers.end()) peers.push_back(op.peer);
  return peers;
}

}  // namespace

NcclTransport::NcclTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                             std::chrono::milliseconds timeout, std::shared_ptr<NcclComm> comm)
    : rank_(rank),
      size_(size),
      timeout_(timeout),
      comm_(comm ? std::move(comm)
                 : std::make_shared<NcclComm>(std::move(store), rank, size, timeout)),
      watchdog_(comm_, rank) {}

NcclTransport::~NcclTransport() { shutdown(); }

void NcclTransport::shutdown() {
  watchdog_.stop();
  comm_->destroy();
}

void NcclTransport::abort(const std::string& reason) { comm_->abort(reason); }

c10::intrusive_ptr<NcclWork> NcclTransport::launch(comm::WorkInfo info,
                                                   const std::vector<at::Tensor>& inputs,
                                                   std::vector<at::Tensor> outputs,
                                                   const Enqueue& enqueue, LaunchOptions options) {
  if (options.connect) {
    const auto& any = !inputs.empty() ? inputs : outputs;  // scatter off the root: no inputs
    if (!any.empty()) comm_->connect(any[0].device().index());
  }
  ncclComm_t comm = comm_->require(info.what);
  const c10::Device dev = comm_->device();
  c10::cuda::CUDAGuard guard(dev);
  auto stream = comm_->stream();
  followCaller(dev, stream);
  if (info.timeout <= std::chrono::milliseconds(0)) info.timeout = timeout_;
  // The Work (which the watchdog holds and may be the last to drop) holds only Python-free
  // shallow copies of the outputs (common/handoff.h): a process that exits without
  // destroy_process_group never has the watchdog free a Python-owned TensorImpl.
  auto work = c10::make_intrusive<NcclWork>(rank_, std::move(info), dev, handOff(outputs),
                                            comm_, options.cpu_sync);
  {
    c10::cuda::CUDAStreamGuard sg(stream);
    const int64_t calls = ncclCallsOnThisThread();
    try {
      enqueue(comm, stream.stream());
    } catch (const std::exception& e) {
      // Some of the operation may already be queued on this rank and its peers' halves may be
      // running: the communicator cannot be trusted any more, every rank must fail fast.
      if (ncclCallsOnThisThread() != calls)
        comm_->abort(std::string("an NCCL call failed while launching ") + work->info().what +
                     ": " + e.what());
      throw;
    }
    // The caching allocator reuses the buffers only after the work queued on the comm stream so
    // far is done, so nothing else keeps them: a ring step's K/V and dK/dV are freed as soon as
    // the caller drops them, not when the watchdog sees the end event.
    const std::vector<at::Tensor>* lists[] = {&inputs, &outputs};
    for (const auto* list : lists)
      for (const auto& t : *list)
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
    work->recordEnd(stream);
  }
  watchdog_.track(work);
  return work;
}

std::unique_ptr<comm::PendingExchange> NcclTransport::exchange(const std::vector<comm::P2POp>& ops,
                                                               const std::string& what) {
  checkPeers(ops, rank_, size_, what);
  connectForP2P(*comm_, size_, ops);
  comm_->require(what);
  std::vector<at::Tensor> ts;
  for (const auto& op : ops) ts.push_back(op.tensor);
  checkNcclTensors(ts, comm_->device(), what);
  comm::WorkInfo info;
  info.what = what;
  info.peers = peersOf(ops);
  info.timeout = timeout_;
  return std::make_unique<NcclExchange>(launch(
      std::move(info), ts, {}, [&](ncclComm_t c, cudaStream_t s) { enqueueP2P(ops, c, s, what); },
      {}));
}

c10::intrusive_ptr<c10d::Work> NcclTransport::post(const std::vector<comm::P2POp>& ops,
                                                   comm::WorkInfo info) {
  checkPeers(ops, rank_, size_, info.what);
  std::vector<at::Tensor> ts;
  for (const auto& op : ops) ts.push_back(op.tensor);
  const std::string what = info.what;
  connectForP2P(*comm_, size_, ops);
  comm_->require(what);
  checkNcclTensors(ts, comm_->device(), what);
  return launch(std::move(info), ts, ts,
                [&](ncclComm_t c, cudaStream_t s) { enqueueP2P(ops, c, s, what); }, {});
}

c10::intrusive_ptr<c10d::Work> NcclTransport::run(comm::WorkInfo info,
                                                  std::vector<at::Tensor> outputs,
                                                  std::function<void()> body,
                                                  std::vector<at::Tensor> inputs) {
  // A world of one has no peer to deadlock with: create the communicator on first use. With
  // more ranks it must come from a world collective (or device_id=), run by every rank.
  if (size_ == 1 && !outputs.empty() && outputs[0].is_cuda())
    comm_->connect(outputs[0].device().index());
  return launch(std::move(info), inputs, std::move(outputs),
                [&](ncclComm_t, cudaStream_t) { body(); }, {});
}

}  // namespace cuda
}  // namespace bytescale
