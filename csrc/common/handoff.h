// Tensors handed to a thread that may drop the last reference to them: shallow copies.
//
// Freeing a TensorImpl that owns a Python object (any tensor Python has seen, once Python let go
// of its wrapper first) takes the GIL. On a C++ worker thread that is a deadlock when the thread
// that holds the GIL waits for the worker (joins it, say in a destructor called from Python), and
// an abort while the interpreter finalizes: Python ends the thread with pthread_exit and the
// unwinding hits a noexcept frame ("terminate called without an active exception"). A shallow
// copy shares the storage, sizes, strides and version counter but not the TensorImpl, so it has no
// Python object: a worker that frees it never touches Python. Hand one to the worker, and give the
// caller a copy of what the worker made, never the worker's own TensorImpl.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace bytescale {

// A shallow copy of `t` without its Python object; `t` itself when undefined or a Python tensor
// subclass (whose copy would call into Python).
inline at::Tensor handOff(const at::Tensor& t) {
  c10::TensorImpl* impl = t.defined() ? t.unsafeGetTensorImpl() : nullptr;
  if (!impl || impl->key_set().has(c10::DispatchKey::Python)) return t;
  return at::Tensor(
      impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change()));
}

inline std::vector<at::Tensor> handOff(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(handOff(t));
  return out;
}

}  // namespace bytescale
