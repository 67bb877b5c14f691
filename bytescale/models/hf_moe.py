"""An HF transformers Mixtral under the package's MoE machinery: dispatch, expert parallelism, an
HDP-correct balance loss.

:func:`hf_moe_model` turns ``MixtralForCausalLM`` (built with ``attn_implementation="bytescale"``)
into a module with the step executor's stage model protocol (an
:class:`~bytescale.models.hf_stage.HFPipelineStage`, the whole model when ``stages == 1``) whose
every ``MixtralSparseMoeBlock`` is replaced by an :class:`HFSparseMoE`:

* routing is HF's own: the block's ``gate`` (``MixtralTopKRouter``: softmax of the router logits in
  float32, top-``num_experts_per_tok``, the chosen weights renormalised to sum to 1) is called
  unchanged, so the chosen experts and weights are exactly those of the unmodified model;
* the experts are HF's fused ``experts.gate_up_proj`` (E, 2I, H) / ``experts.down_proj`` (E, H, I)
  cut into one module per expert (``mlp.experts.<e>.gate_up_proj`` (2I, H), ``.down_proj`` (H, I),
  ``e`` the global expert index), run by :meth:`bytescale.models.moe.MoE.run_experts`: locally, or
  after :func:`bytescale.models.expert_parallel.expert_parallel` with the package's dropless uneven
  all-to-all over the EP group, each rank keeping its E / ep experts. The names do not depend on
  the EP degree, so a checkpoint written at one degree loads at another; they are not HF's fused
  names (convert with :func:`fused_expert_weights` / :func:`split_expert_weights`);
* the balance loss is HF's Switch-Transformer loss made exact under HDP. HF's
  ``load_balancing_loss_func`` is a mean over the forward call's tokens, so under HDP (each rank
  its own micro-batches) its sum over ranks is not the loss of the global batch. Here, per MoE
  layer ``l`` and document ``d`` (length ``n_d``) of the global batch (``G`` tokens)::

      L_aux = router_aux_loss_coef * (1 / L) * sum_l sum_d (n_d / G) * E * sum_e c_lde / n_d * P_lde
      c_lde = tokens of d that layer l routes to expert e (each token counts top_k times in total;
              no gradient)
      P_lde = (sum over d's tokens of layer l's router probability of e) / n_d

  with ``L = num_hidden_layers`` and the probabilities the softmax of the router logits in the
  model's dtype (float32 for 16-bit models). For one MoE layer and one document this is HF's loss
  exactly (HF pools the counts and probabilities of all layers before the product, where this
  averages the per-layer products, which pipeline stages can add). It is
  :func:`bytescale.models.moe.balance_loss` (a document sharded over a ring all-reduces its counts
  over the ring) times ``top_k / L * router_aux_loss_coef``; summed over ranks and micro-batches it
  is the global batch's loss, so HDP training equals single-process training. The stage's
  ``forward(..., return_aux=True)`` returns it as ``aux``; the step executor adds it to the
  token-level loss.

``router_jitter_noise`` > 0 is refused (random per forward: no equality with a reference).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.api import current_layout
from .hf_stage import HFPipelineStage
from .moe import MoE, balance_loss

__all__ = ["HF_MOE_TYPES", "HFExpert", "HFSparseMoE", "HFMoEStage", "hf_moe_model", "is_hf_moe",
           "fused_expert_weights", "split_expert_weights"]

HF_MOE_TYPES = ("mixtral",)  # model types whose sparse-MoE block is checked to be Mixtral's (gate + fused experts)


def _err(msg: str) -> ValueError:
    return ValueError(f"hf_moe_model: {msg}")


def is_hf_moe(model: nn.Module) -> bool:
    """Whether ``model`` is an HF causal LM whose MoE blocks :func:`hf_moe_model` can take over."""
    return getattr(getattr(model, "config", None), "model_type", None) in HF_MOE_TYPES


class HFExpert(nn.Module):
    """One Mixtral expert cut from HF's fused tensors: ``down(act(x @ gate.T) * (x @ up.T))`` with
    ``gate_up_proj`` (2I, H) (gate rows first, as HF's ``chunk(2)`` reads them) and ``down_proj`` (H, I)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up.detach().clone())
        self.down_proj = nn.Parameter(down.detach().clone())
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


class _AuxSink:
    """The balance-loss terms of one stage forward (None outside it: a recomputation in backward
    adds nothing)."""

    def __init__(self) -> None:
        self.terms: Optional[List[torch.Tensor]] = None


class HFSparseMoE(MoE):
    """A ``MixtralSparseMoeBlock`` on the package's MoE (module docstring): HF's ``gate``, the
    experts one module each, :meth:`MoE.run_experts` (local or EP dispatch). It is a
    :class:`~bytescale.models.moe.MoE` so that :func:`~bytescale.models.expert_parallel.expert_parallel`,
    ``expert_param_groups`` and ``expert_norm_groups`` treat it as the package's own."""

    def __init__(self, block: nn.Module, sink: _AuxSink) -> None:
        nn.Module.__init__(self)  # not MoE.__init__: the router and experts are HF's
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if gate is None or not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3:
            raise _err(f"{type(block).__name__} is not transformers 5.x's Mixtral sparse-MoE block (a gate and "
                       "fused experts.gate_up_proj (E, 2I, H) / experts.down_proj (E, H, I)); this transformers "
                       "version's layout is not supported")
        if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
            raise _err(f"router_jitter_noise={block.jitter_noise}: random per forward, no equal reference; set it to 0")
        n, top_k = int(gu.shape[0]), int(block.top_k)
        if down.shape[0] != n or gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
            raise _err(f"expert shapes gate_up_proj {tuple(gu.shape)} / down_proj {tuple(down.shape)} do not match")
        self.top_k, self.n_experts = top_k, n
        self.gate = gate  # HF's router, parameter name unchanged (mlp.gate.weight)
        self.experts = nn.ModuleList(HFExpert(gu[e], down[e], experts.act_fn) for e in range(n))
        self.ep_group, self.edp_group, self.ep_size = None, None, 1
        self._sink = sink

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, top_w, top_i = self.gate(x)  # HF's routing, unchanged
        out = self.run_experts(x, top_w.to(x.dtype), top_i)
        probs = torch.softmax(logits if logits.dtype in (torch.float32, torch.float64) else logits.float(), -1)
        # global_tokens=1: the stage divides by the global batch's tokens (module docstring). Computed
        # in an activation checkpoint's recomputation too (the same saved tensors, the same ring
        # all-reduce of a sharded document's counts), kept only in the stage's forward
        aux = balance_loss(probs, top_i, current_layout(), 1, self.top_k)
        if self._sink.terms is not None:
            self._sink.terms.append(aux)
        return out.reshape(shape)


class HFMoEStage(HFPipelineStage):
    """Stage ``stage`` of ``stages`` of an HF Mixtral with :class:`HFSparseMoE` blocks; ``forward``
    returns ``(out, aux)`` with ``aux`` this stage's share of the balance loss (module docstring).
    ``ep_size`` is the EP degree (set by ``expert_parallel``; the step executor's schedule reads it)."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        if not is_hf_moe(model):
            raise _err(f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r}) "
                       f"is not one of {HF_MOE_TYPES}")
        config = model.config
        super().__init__(model, stage, stages)
        self._sink = _AuxSink()
        for layer in self.layers.values():
            if isinstance(layer.mlp, HFSparseMoE):
                raise _err("the model's MoE blocks are already replaced")
            layer.mlp = HFSparseMoE(layer.mlp, self._sink)
        first = next(iter(self.layers.values())).mlp
        self.n_experts, self.top_k = first.n_experts, first.top_k
        self.n_moe_layers = int(config.num_hidden_layers)
        self.router_aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        self.ep_size = 1

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                layout=None, *, global_tokens: Optional[int] = None, return_aux: bool = False,
                hidden: Optional[torch.Tensor] = None):
        self._sink.terms = []
        try:
            out = super().forward(input_ids, position_ids, layout, global_tokens=global_tokens, hidden=hidden)
            terms = self._sink.terms
        finally:
            self._sink.terms = None
        if not return_aux:
            return out
        tokens = out.shape[0]
        g = float(global_tokens if global_tokens else max(tokens, 1))
        aux = torch.stack(terms).sum() * (self.router_aux_coef * self.top_k / (self.n_moe_layers * g))
        if tokens == 0:  # the dummy token of an empty entry counts nothing
            aux = aux * 0
        return out, aux


def hf_moe_model(model: nn.Module, stage: int = 0, stages: int = 1) -> HFMoEStage:
    """``model`` (an HF ``MixtralForCausalLM`` initialised alike on every rank, built with
    ``attn_implementation="bytescale"``) as stage ``stage`` of ``stages`` with the package's MoE
    blocks and balance loss (module docstring); ``stages == 1``: the whole model. ``model`` is taken
    apart (its modules move into the returned one). Then ``expert_parallel(stage, mesh)`` shards the
    experts. Raises ValueError for what :func:`~bytescale.models.hf_stage.hf_pipeline_stage` refuses,
    a model type not in :data:`HF_MOE_TYPES`, another sparse-MoE layout, or router jitter."""
    return HFMoEStage(model, stage, stages)


def fused_expert_weights(state: Dict[str, Any], n_experts: int) -> Dict[str, Any]:
    """A state dict with :class:`HFExpert` names (``...mlp.experts.<e>.gate_up_proj``) -> HF's fused
    names (``...mlp.experts.gate_up_proj`` (E, 2I, H)); needs every expert (EP degree 1)."""
    out: Dict[str, Any] = {}
    groups: Dict[str, Dict[int, Any]] = {}
    for k, v in state.items():
        head, sep, tail = k.rpartition(".experts.")
        idx, _, leaf = tail.partition(".")
        if sep and idx.isdigit() and leaf in ("gate_up_proj", "down_proj"):
            groups.setdefault(f"{head}.experts.{leaf}", {})[int(idx)] = v
        else:
            out[k] = v
    for k, per in groups.items():
        if sorted(per) != list(range(n_experts)):
            raise ValueError(f"fused_expert_weights: {k} has experts {sorted(per)}, not all {n_experts}")
        out[k] = torch.stack([per[e] for e in range(n_experts)])
    return out


def split_expert_weights(state: Dict[str, Any]) -> Dict[str, Any]:
    """HF's fused expert tensors -> one entry per expert (:class:`HFExpert` names); the inverse of
    :func:`fused_expert_weights`."""
    out: Dict[str, Any] = {}
    for k, v in state.items():
        head, sep, leaf = k.rpartition(".experts.")
        if sep and leaf in ("gate_up_proj", "down_proj") and getattr(v, "dim", lambda: 0)() == 3:
            for e in range(v.shape[0]):
                out[f"{head}.experts.{e}.{leaf}"] = v[e]
        else:
            out[k] = v
    return out
