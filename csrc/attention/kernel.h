// The per-ring-step attention kernel interface, the registry of kernels, and the one function that
// chooses a step's kernel.
//
// A step is the queries a rank holds against one K/V block (BlockPair, block_step.h). Kernels:
//   "tiled"  (rank 0)  built in (block_attention.h): any device, any floating dtype, any head dim.
//   "sdpa"   (rank 5)  CPU, fp32/fp64/bf16: ATen's fused CPU flash attention per segment
//                      (sdpa_cpu_block.cpp), registered at load.
//   "flash"  (rank 10) CUDA plug-in (csrc/cuda/attention/flash_block.cpp), registered at load.
//   "cudnn"  (rank 20) CUDA plug-in (csrc/cuda/attention/cudnn_block.cpp), registered at load.
// A CPU-only build registers no CUDA plug-in; CPU steps run on "sdpa" (fp16: tiled).
//
// chooseKernel picks, among the kernels registered for q's device type that are available on
// q's device, the highest-ranked one that accepts the step:
//   choice "auto"  (default): only kernels that also prefer the device (cuDNN: Hopper);
//   choice NAME: the kernel NAME and those ranked below it, device preference ignored
//                (=cudnn falls back to flash for steps cuDNN does not take; =tiled: tiled only;
//                a NAME no registered kernel has means tiled).
// The choice is BYTESCALE_ATTENTION_KERNEL (env::knobs(), read once) unless setKernelChoice
// changed it. Device facts (availableOn / prefersDevice: compute capability) are asked once per
// device and cached; per step only accepts() runs, which looks at q and the step, never the device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention/block_step.h"

namespace bytescale {
namespace attention {

class BlockKernel {
 public:
  virtual ~BlockKernel() = default;

  virtual std::string name() const = 0;
  // Preference order: higher ranks are tried first (tiled, the fallback, is 0).
  virtual int rank() const = 0;

  // Device facts, asked once per device (chooseKernel caches them).
  virtual bool availableOn(const c10::Device& device) const = 0;
  virtual bool prefersDevice(const c10::Device& device) const { return true; }

  // Per step, cheap: whether the kernel takes these queries and this step (dtype, head dim, the
  // step's segment plan, an earlier run-time rejection). q, k, v were validated at op entry.
  virtual bool accepts(const at::Tensor& q, const BlockPair& bp) const = 0;
  // True once the kernel rejected a configuration at run time and refuses every later step.
  virtual bool disabled() const { return false; }

  // The step functions (contracts as forwardStep / attendOnce / backwardStep in block_step.h).
  // Each returns false when the kernel rejects the configuration at run time: the accumulators
  // are then untouched, the kernel is disabled(), and the step runs on the next kernel down.
  virtual bool forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const BlockPair& bp, double scale, at::Tensor& out, at::Tensor& lse) const = 0;
  // Default: fresh accumulators, forward(), output cast to q's dtype.
  virtual std::optional<std::tuple<at::Tensor, at::Tensor>> attend(const at::Tensor& q,
                                                                   const at::Tensor& k,
                                                                   const at::Tensor& v,
                                                                   const BlockPair& bp,
                                                                   double scale) const;
  virtual bool backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                        at::Tensor& delta, const BlockPair& bp, double scale, at::Tensor& dq,
                        at::Tensor& dk, at::Tensor& dv) const = 0;
};

// Registers a kernel for tensors of one device type; called by plug-ins from static initialisers
// when the extension loads. Throws std::invalid_argument for a duplicate name or a rank <= 0.
void registerKernel(c10::DeviceType device, std::shared_ptr<const BlockKernel> kernel);

// The built-in tiled kernel.
const BlockKernel& tiledKernel();

// The registered kernel called `name` (any device type), or nullptr.
const BlockKernel* findKernel(const std::string& name);

// Names of the kernels registered for a device type, highest rank first (tiled not included).
std::vector<std::string> kernelNames(c10::DeviceType device);

// The kernel for one step. `below`: only kernels ranked lower (after `below` rejected the step).
const BlockKernel& chooseKernel(const at::Tensor& q, const BlockPair& bp,
                                const BlockKernel* below = nullptr);

// The kernel choice in force ("auto", "flash", "cudnn", "sdpa" or "tiled"); starts as
// BYTESCALE_ATTENTION_KERNEL. setKernelChoice changes it for the process (tests, benchmarks) and
// throws std::invalid_argument for another name.
std::string kernelChoice();
void setKernelChoice(const std::string& choice);

}  // namespace attention
}  // namespace bytescale
