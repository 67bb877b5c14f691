// Every BYTESCALE_* environment knob the C++ code reads, read once per process (first use) and
// documented here. Pure C++ (no torch). The Python list of knobs is bytescale/config.py.
//
//   BYTESCALE_CHECK_COLLECTIVES  "0" turns off the cross-rank fingerprint check before CPU
//                                collectives (default on). Same value on every rank.
//   BYTESCALE_CHECK_RING         "0" turns off the ring agreement check before ring attention moves
//                                K/V (default on; csrc/attention/ring_agreement.h). Same value on
//                                every rank.
//   BYTESCALE_ATTENTION_KERNEL   "auto" (default), "flash", "cudnn" or "tiled": the per-ring-step
//                                attention kernel on CUDA (csrc/attention/kernel.h chooses).
//   BYTESCALE_NCCL_ORDER         "1": CUDA's execution model on CPU, for tests (default off). The
//                                CPU transport runs every operation of a rank (world and
//                                dynamic-group collectives, point-to-point exchanges) on ONE
//                                in-order queue in issue order, as NCCL runs them on one stream
//                                (comm/gloo_transport.h), and bytescale.testing runs every
//                                backward on a separate thread, as CUDA autograd does.
//   BYTESCALE_CUDA_TRANSPORT     "nccl" (default) or "staged": the transport of CUDA tensors.
//                                "staged" (a development and test tool, comm/staged_transport.h)
//                                copies every message through pinned host memory over the CPU
//                                (Gloo) transport, so several processes can share ONE GPU (NCCL
//                                refuses two ranks on one GPU). Same value on every rank.
#pragma once

#include <string>

namespace bytescale {
namespace env {

struct Knobs {
  bool check_collectives = true;
  bool check_ring = true;
  std::string attention_kernel = "auto";
  bool nccl_order = false;
  std::string cuda_transport = "nccl";
};

// The knobs as read from the environment at first call (thread-safe, never re-read).
const Knobs& knobs();

// Parses the environment now (tests); `knobs()` keeps its first value.
Knobs readKnobs();

// Throws std::invalid_argument unless `s` is a valid BYTESCALE_ATTENTION_KERNEL value (also for
// the programmatic override, attention::setKernelChoice).
void checkAttentionKernel(const std::string& s);

}  // namespace env
}  // namespace bytescale
