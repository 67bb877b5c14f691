// Device plug-ins of the communication subsystem.
//
// The comm subsystem itself knows CPU tensors only (Gloo and the P2P algorithms). A device plug-in
// (the NCCL backend of csrc/cuda/comm/, built only with CUDA) registers a factory here at load
// time; the world backend asks for it when it is created. Dependencies point one way: csrc/cuda/comm
// includes csrc/comm, never the reverse.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/front_end.h"
#include "comm/transport.h"

namespace bytescale {
namespace comm {

struct DeviceBackendOptions {
  c10::intrusive_ptr<c10d::Store> store;  // the world's store (communicator rendezvous)
  int rank = 0;                           // global rank
  int size = 1;                           // world size
  std::chrono::milliseconds timeout{0};   // the world group's timeout
  std::shared_ptr<Transport> cpu;         // the group's CPU transport (staged transports use it)
};

struct DeviceBackend;

// Splits a plug-in's communicator (a static group's from its parent's; collective over every rank
// of the parent group). `group`: the new group's store, this rank's place in it and its size;
// color >= 0 for the members (the same value on all of them, distinct between the groups of one
// split), < 0 for a rank outside every new group (returns an empty DeviceBackend); key orders the
// members.
using DeviceBackendSplit =
    std::function<DeviceBackend(const DeviceBackendOptions& group, int color, int key)>;

// What a plug-in provides for a group (the world, or a static group) on its device.
struct DeviceBackend {
  // Executor of the group's collectives on this device (BytescaleBackend hands it the validated
  // Collective); also a complete c10d backend of its own.
  c10::intrusive_ptr<CollectiveBackend> backend;
  // The transport of the device (the world's: dynamic groups, ring attention).
  std::shared_ptr<Transport> transport;
  // Whether the device's world communicator exists (NCCL: created by device_id= or the first
  // world collective); null: nothing to create.
  std::function<bool()> connected;
  // Splits this plug-in's communicator (null: the plug-in cannot split).
  DeviceBackendSplit split;
};

using DeviceBackendFactory = std::function<DeviceBackend(const DeviceBackendOptions&)>;

// Registers the plug-in of `device` (the last registration wins). Call from a static initializer
// or from module init.
void registerDeviceBackend(c10::DeviceType device, DeviceBackendFactory factory);
bool hasDeviceBackend(c10::DeviceType device);
// Creates the plug-in's backend; raises naming the device when none is registered.
DeviceBackend makeDeviceBackend(c10::DeviceType device, const DeviceBackendOptions& options);

// A transport for `device` registered by the world backend, or an error naming what is missing.
std::shared_ptr<Transport> requireTransport(c10::DeviceType device, const std::string& what);

}  // namespace comm
}  // namespace bytescale
