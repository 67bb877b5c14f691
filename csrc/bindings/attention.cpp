// Python bindings of the attention subsystem's building blocks (the ops themselves are
// TORCH_LIBRARY ops, csrc/attention/ring_attention.cpp): segment plans, the kernel registry and
// choice (csrc/attention/kernel.h), and the log-sum-exp merge op, exposed for tests and benchmarks.
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "attention/block_plan.h"
#include "attention/block_step.h"
#include "attention/kernel.h"
#include "attention/ring_agreement.h"
#include "bindings/bindings.h"

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

  m.def("kernels", [](const std::string& device) {
          return attention::kernelNames(c10::Device(device).type());
        }, py::arg("device") = "cuda",
        "Names of the plug-in kernels registered for a device type, preferred first (the built-in "
        "'tiled' kernel is always there and not listed).");
  m.def("has_cuda_kernels", []() { return !attention::kernelNames(c10::DeviceType::CUDA).empty(); },
        "True when the CUDA plug-in registered its kernels (a CUDA build).");
  m.def("kernel_for", [](const at::Tensor& q, const std::vector<int64_t>& doc_lens, bool causal) {
          TORCH_CHECK(q.dim() == 3, "kernel_for: q must be (tokens, heads, head_dim), got ", q.sizes());
          return attention::chooseKernel(q, attention::BlockPair{doc_lens, 0, 0, 0, causal}).name();
        }, py::arg("q"), py::arg("doc_lens"), py::arg("causal") = true,
        "The kernel a varlen attention step of q (T, H, D) over these local documents runs on.");
  m.def("flash_usable", [](const at::Tensor& q) {
          TORCH_CHECK(q.dim() == 3, "flash_usable: q must be (tokens, heads, head_dim), got ", q.sizes());
          const std::vector<int64_t> lens{q.size(0)};
          return attention::chooseKernel(q, attention::BlockPair{lens, 0, 0, 0, true}).name() != "tiled";
        }, py::arg("q"), "True when q's attention steps run on a fused kernel (CUDA flash / cuDNN, CPU sdpa).");
  m.def("cudnn_failed", []() {
          const auto* k = attention::findKernel("cudnn");
          return k != nullptr && k->disabled();
        }, "True once cuDNN rejected a configuration (steps then use flash attention).");
  m.def("enter_agreement_scope", &attention::enterAgreementScope,
        "Start a micro-batch's agreement scope (ring calls agreed once per scope); returns the "
        "scope to restore with exit_agreement_scope.");
  m.def("exit_agreement_scope", &attention::exitAgreementScope, py::arg("previous"));
  m.def("ring_agreement_exchanges", &attention::ringAgreementExchanges,
        "Ring agreement exchanges this process ran so far.");
  m.def("ring_checks_enabled", &attention::ringChecksEnabled,
        "Whether ring attention's members check that they agree on the call before K/V moves.");
  m.def("set_ring_checks", &attention::setRingChecksEnabled, py::arg("enabled"),
        "Turn ring attention's agreement check on or off (default on; env BYTESCALE_CHECK_RING=0 "
        "turns it off). Every rank must use the same setting.");
  m.def("kernel_choice", &attention::kernelChoice,
        "The kernel choice in force: BYTESCALE_ATTENTION_KERNEL unless set_kernel_choice changed it.");
  m.def("set_kernel_choice", &attention::setKernelChoice, py::arg("choice"),
        "Sets the kernel choice for this process: 'auto', 'flash', 'cudnn', 'sdpa' or 'tiled'.");
  m.def("merge_lse_", [](at::Tensor out, at::Tensor lse, const at::Tensor& out_b, const at::Tensor& lse_b) {
          static const auto op = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("bytescale::merge_lse_", "")
                                      .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&)>();
          op.call(out, lse, out_b, lse_b);
        }, py::arg("out"), py::arg("lse"), py::arg("out_b"), py::arg("lse_b"),
        "In-place log-sum-exp merge of (out_b, lse_b) into (out, lse): torch.ops.bytescale.merge_lse_.");
}

}  // namespace bytescale
