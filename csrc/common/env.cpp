#include "common/env.h"

#include <cstdlib>
#include <stdexcept>

namespace bytescale {
namespace env {

void checkAttentionKernel(const std::string& s) {
  if (s != "auto" && s != "flash" && s != "cudnn" && s != "sdpa" && s != "tiled")
    throw std::invalid_argument("BYTESCALE_ATTENTION_KERNEL='" + s +
                                "': expected auto, flash, cudnn, sdpa or tiled");
}

Knobs readKnobs() {
  Knobs k;
  if (const char* v = std::getenv("BYTESCALE_CHECK_COLLECTIVES"))
    k.check_collectives = std::string(v) != "0";
  if (const char* v = std::getenv("BYTESCALE_CHECK_RING")) k.check_ring = std::string(v) != "0";
  if (const char* v = std::getenv("BYTESCALE_NCCL_ORDER")) {
    const std::string s(v);
    if (s != "" && s != "0" && s != "1")
      throw std::invalid_argument("BYTESCALE_NCCL_ORDER='" + s + "': expected 0 or 1");
    k.nccl_order = s == "1";
  }
  if (const char* v = std::getenv("BYTESCALE_CUDA_TRANSPORT")) {
    const std::string s(v);
    if (!s.empty()) {
      if (s != "nccl" && s != "staged")
        throw std::invalid_argument("BYTESCALE_CUDA_TRANSPORT='" + s + "': expected nccl or staged");
      k.cuda_transport = s;
    }
  }
  if (const char* v = std::getenv("BYTESCALE_ATTENTION_KERNEL")) {
    std::string s(v);
    if (s.empty()) s = "auto";
    checkAttentionKernel(s);
    k.attention_kernel = s;
  }
  return k;
}

const Knobs& knobs() {
  static const Knobs k = readKnobs();
  return k;
}

}  // namespace env
}  // namespace bytescale
