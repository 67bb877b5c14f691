"""Tensor parallelism inside an HDP unit, through ``torch.distributed.tensor.parallel``.

:func:`tensor_parallel` gives the package's Llama (dense and MoE) the Megatron / TorchTitan plan on
a TP DeviceMesh (``bytescale.init_mesh(tp=T)["tp"]``):

* attention: ``wq``/``wk``/``wv`` column-wise (each rank computes ``n_heads / T`` query heads and
  their KV heads), ``wo`` row-wise; when T exceeds the KV heads (GQA), the K/V weights stay
  replicated and each rank computes the one KV head its query heads use (the weight's and the
  input's gradients are all-reduced over TP in backward);
* MLP: ``w1``/``w3`` column-wise, ``w2`` row-wise; MoE: every expert the same, the router
  replicated;
* the embedding vocabulary-parallel (row-wise), the LM head column-wise with its output sharded
  over the vocabulary for :func:`torch.distributed.tensor.parallel.loss_parallel` (the
  cross-entropy then never gathers the logits);
* optional sequence parallelism: norms run on ``T / TP`` tokens (the packed token dimension 0 is
  the sequence), all-gathered before attention and the MLP, reduce-scattered after.

Every parameter becomes a DTensor on the TP mesh (norms and the router replicated), so FSDP2 over
the HDP dimension composes as in TorchTitan and a checkpoint reshards across TP degrees.
Attention runs on the rank's local heads through bytescale's ring and varlen ops unchanged (a ring
runs once per TP index, among the ranks of that index).

HF transformers models use their own plans (:func:`hf_tensor_parallel`: the model's ``tp_plan``,
applied by transformers).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from .llama import Llama
from .moe import MoE
from .tp_ops import local_tensor, shared_kv  # noqa: F401  (re-exported: the model's TP pieces)

__all__ = ["ReplicateParallel", "check_tensor_parallel", "tensor_parallel", "hf_tensor_parallel",
           "shared_kv", "local_tensor"]


def _replicate_params(name: str, module: nn.Module, mesh) -> None:
    for pname, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            module.register_parameter(
                pname, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]), requires_grad=p.requires_grad))


def _replicated_inputs(module: nn.Module, inputs: Tuple[Any, ...], mesh) -> Tuple[Any, ...]:
    out = []
    for x in inputs:
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Replicate()])
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        out.append(x)
    return tuple(out)


def _local_outputs(module: nn.Module, outputs: Any, mesh) -> Any:
    if isinstance(outputs, DTensor):
        return outputs.to_local()
    if isinstance(outputs, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
    return outputs


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the TP mesh as DTensors; floating inputs taken as replicated and
    outputs returned as local tensors (``hooks=False``: parameters only). For modules every TP
    rank computes in full on the same replicated input: norms without sequence parallelism, the MoE
    router, K/V projections shared by several ranks."""

    def __init__(self, *, hooks: bool = True) -> None:
        super().__init__()
        self.hooks = hooks

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not self.hooks:
            return distribute_module(module, device_mesh, _replicate_params)
        return distribute_module(module, device_mesh, _replicate_params, _replicated_inputs, _local_outputs)


def check_tensor_parallel(n_heads: int, n_kv_heads: int, tp: int, what: str = "the model") -> None:
    """Raise ValueError naming the values when ``tp`` cannot split ``n_heads`` query heads and
    ``n_kv_heads`` KV heads (GQA: T must divide the query heads, and the KV heads and T must divide
    one another)."""
    if tp < 1:
        raise ValueError(f"tensor parallelism: TP degree must be >= 1, got {tp}")
    if tp > n_heads:
        raise ValueError(f"tensor parallelism: TP degree {tp} is larger than the {n_heads} attention heads of "
                         f"{what}; use tp <= {n_heads}")
    if n_heads % tp:
        raise ValueError(f"tensor parallelism: TP degree {tp} does not divide the {n_heads} attention heads of "
                         f"{what}")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ValueError(f"tensor parallelism: TP degree {tp} and the {n_kv_heads} KV heads of {what}: one must "
                         "divide the other (KV heads are sharded, or replicated when TP exceeds them)")


def tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False,
                    loss_parallel: bool = True) -> nn.Module:
    """Apply the TP plan (module docstring) to the package's Llama in place; returns it.

    ``loss_parallel``: the logits come back as a DTensor sharded over the vocabulary; compute the
    loss (and run backward) inside ``torch.distributed.tensor.parallel.loss_parallel()``
    (the step executor does). Raises ValueError when the TP degree does not fit the heads.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"tensor_parallel: expected bytescale.models.Llama, got {type(model).__name__} "
                        "(HF models: hf_tensor_parallel)")
    cfg = model.cfg
    tp = tp_mesh.size()
    check_tensor_parallel(cfg.n_heads, cfg.n_kv_heads, tp, "this Llama")
    if tp == 1:
        return model
    sp = bool(sequence_parallel)
    seq = Shard(0)  # packed (tokens, dim): dimension 0 is the sequence
    t = tp_mesh.get_local_rank()
    group = tp_mesh.get_group()

    def norm():
        return SequenceParallel(sequence_dim=0) if sp else ReplicateParallel()

    top = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate(),
                                 use_local_output=not sp),
        "norm": norm(),
        "lm_head": ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                   output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    # a pipeline stage holds some of them (Llama.pipeline_stage)
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k) is not None})
    share = tp > cfg.n_kv_heads
    for block in model.layers.values():
        attn = block.attn
        plan: Dict[str, ParallelStyle] = {
            "attn_norm": norm(), "mlp_norm": norm(),
            "attn.wq": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq if sp else Replicate(), use_local_output=not sp),
        }
        if sp:
            plan["attn"] = PrepareModuleInput(input_layouts=(seq, None, None),
                                              desired_input_layouts=(Replicate(), None, None))
        if share:
            plan["attn.wk"] = ReplicateParallel(hooks=False)
            plan["attn.wv"] = ReplicateParallel(hooks=False)
            attn.kv_share = (t // (tp // cfg.n_kv_heads), group)
            attn.n_kv_heads = 1
        else:
            plan["attn.wk"] = ColwiseParallel()
            plan["attn.wv"] = ColwiseParallel()
            attn.n_kv_heads = cfg.n_kv_heads // tp
        attn.n_heads = cfg.n_heads // tp
        moe = getattr(block, "moe", None)
        if isinstance(moe, MoE):
            if sp:
                plan["moe"] = PrepareModuleInputOutput(
                    input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None),
                    use_local_input=True, output_layouts=(Replicate(), None),
                    desired_output_layouts=(seq, None), use_local_output=False)
            plan["moe.router"] = ReplicateParallel()
            for e, _ in moe.local_experts():  # this rank's under expert parallelism
                plan[f"moe.experts.{e}.w1"] = ColwiseParallel()
                plan[f"moe.experts.{e}.w3"] = ColwiseParallel()
                plan[f"moe.experts.{e}.w2"] = RowwiseParallel()
        else:
            if sp:
                plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan["mlp.w1"] = ColwiseParallel()
            plan["mlp.w3"] = ColwiseParallel()
            plan["mlp.w2"] = RowwiseParallel(output_layouts=seq if sp else Replicate(), use_local_output=not sp)
        parallelize_module(block, tp_mesh, plan)
    model.tp_mesh = tp_mesh
    # with pipelines, the hidden states crossing a stage boundary are this rank's sequence shard
    # (Llama.forward wraps a received one back into a DTensor; the stage I/O sends the local part)
    model.sequence_parallel = sp
    model.loss_parallel = bool(loss_parallel) and model.lm_head is not None
    return model


def hf_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Apply an HF transformers model's own TP plan (its config's ``base_model_tp_plan`` and the
    class's ``_tp_plan``) on ``tp_mesh``, through transformers' ``apply_tensor_parallelism``;
    raises ValueError when the model has no plan or its heads do not split."""
    tp = tp_mesh.size()
    hc = model.config
    heads = hc.num_attention_heads
    check_tensor_parallel(heads, getattr(hc, "num_key_value_heads", None) or heads, tp,
                          f"{type(model).__name__}")
    kv = getattr(hc, "num_key_value_heads", None) or heads
    if kv % tp:
        raise ValueError(f"tensor parallelism: TP degree {tp} does not divide the {kv} KV heads of "
                         f"{type(model).__name__}; its transformers TP plan shards them")
    if tp == 1:
        return model
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError as e:  # pragma: no cover - older transformers
        raise ValueError(f"tensor parallelism for HF models needs transformers >= 5 ({e})") from None
    try:
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))
    except ValueError as e:
        raise ValueError(f"tensor parallelism: {type(model).__name__}: {e}") from None
    if not plan:
        raise ValueError(f"tensor parallelism: {type(model).__name__} has no transformers TP plan")
    apply_tensor_parallelism(model, tp_mesh, plan)
    model.tp_mesh = tp_mesh
    model.loss_parallel = False
    return model
