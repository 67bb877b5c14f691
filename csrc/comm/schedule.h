// Pure C++ (no torch): rank maps of dynamic groups and the schedules of the P2P algorithms.
#pragma once
#include <vector>
namespace bytescale {
namespace comm {}
}  // namespace bytescale
