#include "bindings/bindings.h"

namespace bytescale {
void bind_attention(pybind11::module_& m) { (void)m; }
}  // namespace bytescale
