// Python bindings of the attention subsystem's building blocks (the ops themselves are
// TORCH_LIBRARY ops, csrc/attention/ring_attention.cpp): segment plans, and on CUDA builds the
// LSE-merge kernel, exposed for tests and the merge-bandwidth benchmark.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "attention/block_plan.h"
#include "bindings/bindings.h"

#ifdef BYTESCALE_WITH_CUDA
#include "cuda/attention/kernels.h"
#endif

namespace bytescale {

void bind_attention(pybind11::module_& m) {
  namespace py = pybind11;
  using attention::BlockPlan;
  py::class_<BlockPlan>(m, "BlockPlan", "Segments one ring step attends (attention/block_plan.h).")
      .def_readonly("causal", &BlockPlan::causal)
      .def_readonly("q_rows", &BlockPlan::q_rows)
      .def_readonly("k_rows", &BlockPlan::k_rows)
      .def_property_readonly("segments", [](const BlockPlan& p) {
        py::list out;
        for (const auto& s : p.segs) out.append(py::make_tuple(s.q0, s.qn, s.k0, s.kn));
        return out;
      })
      .def("visible_pairs", &BlockPlan::visiblePairs);
  m.def("zigzag_plan", &attention::zigzagPlan, py::arg("lens"), py::arg("n"), py::arg("qpos"),
        py::arg("kpos"), py::arg("causal"));
  m.def("local_plan", &attention::localPlan, py::arg("lens"), py::arg("causal"));
  m.def("has_cuda_kernels", []() {
#ifdef BYTESCALE_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
#ifdef BYTESCALE_WITH_CUDA
  m.def("merge_lse_", [](at::Tensor out, at::Tensor lse, const at::Tensor& out_b,
                         const at::Tensor& lse_b) { cuda::mergeLse(out, lse, out_b, lse_b, at::Tensor()); },
        "In-place log-sum-exp merge of (out_b, lse_b) into (out, lse) on CUDA (identity rows).");
  m.def("flash_usable", &cuda::flashUsable);
  m.def("cudnn_failed", &cuda::cudnnFailed,
        "True once cuDNN rejected a configuration (steps then use flash attention).");
#endif
}

}  // namespace bytescale
