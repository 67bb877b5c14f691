// The Python bindings of bytescale._C live in this folder, one file per subsystem.
// module.cpp defines the module and calls each bind_* function below.
#pragma once

#include <pybind11/pybind11.h>

namespace bytescale {
void bind_comm(pybind11::module_& m);       // comm.cpp: backend, transports, dynamic groups
void bind_planner(pybind11::module_& m);    // planner.cpp: cost model, planner, Plan
void bind_step_model(pybind11::module_& m); // step_model.cpp: Schedule, replays, lockstep (bind_planner calls it)
void bind_attention(pybind11::module_& m);  // attention.cpp: layouts and attention helpers
void bind_offload(pybind11::module_& m);    // offload.cpp: activation offload engine
}  // namespace bytescale
