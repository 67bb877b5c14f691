#include "bindings/bindings.h"

namespace bytescale {
void bind_comm(pybind11::module_& m) { (void)m; }
}  // namespace bytescale
