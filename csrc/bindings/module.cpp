#include "bindings/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "bytescale C++ core: comm backend, ring attention, HDP planner, offload engine";
#ifdef BYTESCALE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  auto comm = m.def_submodule("comm", "communication: backend, transports, dynamic groups");
  bytescale::bind_comm(comm);
  auto planner = m.def_submodule("planner", "HDP planner");
  bytescale::bind_planner(planner);
  auto attention = m.def_submodule("attention", "attention layouts and kernels");
  bytescale::bind_attention(attention);
  auto offload = m.def_submodule("offload", "activation offload engine");
  bytescale::bind_offload(offload);
}
