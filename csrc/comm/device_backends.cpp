#include "comm/device_backends.h"

#include <mutex>
#include <unordered_map>

namespace bytescale {
namespace comm {

namespace {

std::mutex g_mu;

// Never destroyed: a transport still registered at process exit (a process group that was not
// destroyed) must not run its destructor after the CUDA driver or Gloo have shut down.
std::unordered_map<int, std::shared_ptr<Transport>>& transports() {
  static auto* r = new std::unordered_map<int, std::shared_ptr<Transport>>();
  return *r;
}

std::unordered_map<int, DeviceBackendFactory>& factories() {
  static auto* f = new std::unordered_map<int, DeviceBackendFactory>();
  return *f;
}

}  // namespace

// ---- device plug-ins ----------------------------------------------------------------------

void registerDeviceBackend(c10::DeviceType device, DeviceBackendFactory factory) {
  std::lock_guard<std::mutex> g(g_mu);
  factories()[static_cast<int>(device)] = std::move(factory);
}

bool hasDeviceBackend(c10::DeviceType device) {
  std::lock_guard<std::mutex> g(g_mu);
  return factories().count(static_cast<int>(device)) > 0;
}

DeviceBackend makeDeviceBackend(c10::DeviceType device, const DeviceBackendOptions& options) {
  DeviceBackendFactory f;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = factories().find(static_cast<int>(device));
    TORCH_CHECK(it != factories().end(), "bytescale: no communication backend for ",
                c10::DeviceTypeName(device), " tensors in this build",
                device == c10::DeviceType::CUDA ? " (bytescale was built without CUDA)" : "");
    f = it->second;
  }
  return f(options);
}

// ---- the process's world transports -------------------------------------------------------

std::shared_ptr<Transport> worldTransport(c10::DeviceType device) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = transports().find(static_cast<int>(device));
  return it == transports().end() ? nullptr : it->second;
}

void registerWorldTransport(c10::DeviceType device, std::shared_ptr<Transport> transport) {
  std::lock_guard<std::mutex> g(g_mu);
  transports()[static_cast<int>(device)] = std::move(transport);
}

void unregisterWorldTransport(c10::DeviceType device, const Transport* transport) {
  std::shared_ptr<Transport> dropped;  // released outside the lock
  std::lock_guard<std::mutex> g(g_mu);
  auto it = transports().find(static_cast<int>(device));
  if (it != transports().end() && it->second.get() == transport) {
    dropped = std::move(it->second);
    transports().erase(it);
  }
}

std::shared_ptr<Transport> requireTransport(c10::DeviceType device, const std::string& what) {
  auto tr = worldTransport(device);
  TORCH_CHECK(tr, "bytescale ", what, ": no bytescale transport for ", c10::DeviceTypeName(device),
              " tensors (call dist.init_process_group(\"bytescale\") first",
              device == c10::DeviceType::CUDA
                  ? "; on CUDA the world NCCL communicator is created by init_process_group(..., "
                    "device_id=torch.device(\"cuda\", local_rank)) or by the first world "
                    "collective on a CUDA tensor, on every rank; and bytescale must be built with CUDA)"
                  : ")");
  return tr;
}

}  // namespace comm
}  // namespace bytescale
