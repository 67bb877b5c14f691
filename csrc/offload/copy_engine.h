// The copy-engine interface of the offload subsystem: how one device type's tensors travel to host
// memory and back. offload::Engine (offload.h) does the bookkeeping (handles, host pool) for every
// device and hands the copies to the engine of the tensor's device type:
//   CPU   the built-in engine (copy_engine.cpp): a copy worker thread (host to host), so the very
//         bookkeeping the CUDA engine relies on is tested without a GPU;
//   CUDA  csrc/cuda/offload/: pinned host buffers, a D2H and an H2D stream per device, events,
//         no host synchronisation on the hot path; registered when the extension loads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <functional>
#include <memory>

namespace bytescale {
namespace offload {

// The copies of one tensor: started by CopyEngine::toHost, then back to the device.
// offload::Engine calls toDevice() at most once, restored() at most once after it, and
// hostIdle() / waitHostIdle() at any time. Errors of a copy surface in restored() and
// waitHostIdle().
class Transfer {
 public:
  virtual ~Transfer() = default;
  // Starts copying the host tensor back into a new tensor on the source device (the host copy's
  // sizes and strides), allocated for the consumer: by the calling thread on CPU, on the calling
  // thread's current stream on CUDA (the copy stream only writes it).
  virtual void toDevice() = 0;
  // The tensor back on the device, ready for the caller's work: the CPU engine blocks until its
  // copies finished; the CUDA engine makes the caller's current stream wait (no host block).
  virtual at::Tensor restored() = 0;
  // Whether no copy reads or writes the host buffer any more (a non-blocking query), so the
  // buffer can go back to the pool; waitHostIdle blocks until then.
  virtual bool hostIdle() = 0;
  virtual void waitHostIdle() = 0;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Whether host buffers for this engine should be pinned (page-locked).
  virtual bool pinnedHost() const = 0;
  // Starts copying `src` (dense, on this engine's device type) into `host` (CPU, same sizes,
  // strides and dtype). The caller may drop `src` once this returns: its memory is freed when the
  // copy no longer reads it.
  virtual std::unique_ptr<Transfer> toHost(const at::Tensor& src, const at::Tensor& host) = 0;
};

// Registers how to make the copy engine of a device type (plug-ins call it from static
// initialisers when the extension loads; CPU is built in). Each offload::Engine makes its own.
using CopyEngineFactory = std::function<std::unique_ptr<CopyEngine>()>;
void registerCopyEngine(c10::DeviceType device, CopyEngineFactory factory);
bool hasCopyEngine(c10::DeviceType device);
// A new copy engine for a device type; nullptr when none is registered.
std::unique_ptr<CopyEngine> makeCopyEngine(c10::DeviceType device);

// The built-in CPU engine (copy_engine.cpp; registered for CPU tensors).
std::unique_ptr<CopyEngine> makeCpuCopyEngine();

}  // namespace offload
}  // namespace bytescale
