// Python bindings of the offload engine.
#include "bindings/bindings.h"

#include <torch/csrc/utils/pybind.h>

#include "offload/offload.h"

namespace py = pybind11;

namespace bytescale {

void bind_offload(py::module_& m) {
  using offload::Engine;
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
                                              "Asynchronous activation offload engine with a caching host pool.")
      .def(py::init<int64_t>(), py::arg("pool_limit_bytes") = 0)
      .def("offload", &Engine::offload, py::arg("tensor"), py::call_guard<py::gil_scoped_release>(),
           "Starts copying the whole (dense) tensor to host memory; returns its handle. The engine "
           "keeps no reference to the tensor.")
      .def("prefetch", &Engine::prefetch, py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      .def("fetch", &Engine::fetch, py::arg("handle"), py::call_guard<py::gil_scoped_release>(),
           "The tensor back (same sizes, strides, dtype, device), allocated for the caller.")
      .def("discard", &Engine::discard, py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("pending", &Engine::pending)
      .def_property_readonly("offloaded_bytes", &Engine::offloadedBytes)
      .def_property_readonly("pool_reserved_bytes", [](Engine& e) { return e.pool().reservedBytes(); })
      .def_property_readonly("pool_in_use_bytes", [](Engine& e) { return e.pool().inUseBytes(); })
      .def_property_readonly("pool_peak_bytes", [](Engine& e) { return e.pool().peakInUseBytes(); })
      .def("clear_pool", [](Engine& e) { e.pool().clear(); });
}

}  // namespace bytescale
