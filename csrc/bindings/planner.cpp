#include "bindings/bindings.h"

namespace bytescale {
void bind_planner(pybind11::module_& m) { (void)m; }
}  // namespace bytescale
