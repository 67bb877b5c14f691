// numpy helpers the bindings share: read-only views of C++ vectors (no copy; the owner keeps the
// memory alive) and 1-D array arguments.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

namespace bytescale {

// A read-only numpy view of `v` whose base is `owner`.
template <typename T, typename Owner>
pybind11::array view(const std::shared_ptr<Owner>& owner, const std::vector<T>& v) {
  namespace py = pybind11;
  py::array a(py::dtype::of<T>(), {static_cast<py::ssize_t>(v.size())}, {sizeof(T)}, v.data(),
              py::cast(owner));
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

// An array argument as a C-contiguous array of T (cast if needed).
template <typename T>
using Arr = pybind11::array_t<T, pybind11::array::c_style | pybind11::array::forcecast>;

template <typename T>
void check1d(const Arr<T>& a, const char* name) {
  if (a.ndim() != 1)
    throw pybind11::value_error(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) +
                                " dimensions");
}

}  // namespace bytescale
