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

**Local compute** (``compute="local"``, the default). The layers compute on the local shards of
their parameters with plain tensors, and the plan's communication is explicit (``tp_ops``'
autograd functions, as Megatron-LM's layers do): a module whose layers split over TP (attention,
MLP, LM head) takes its input whole, its gradient summed over TP on the way back (all-reduce, or
under sequence parallelism an all-gather of the rows whose backward reduce-scatters); row-wise
layers sum their partial products (all-reduce, or a reduce-scatter of the rows); the MoE's
router computes whole on every rank, so each expert's column-wise layers sum their own input's
gradient. The vocabulary-parallel logits stay a ``Shard(-1)`` DTensor, which
:func:`bytescale.token_level_loss` reduces without gathering them. Why: DTensor caches each op's
sharding propagation by input shapes, and under HDP nearly every micro-batch has a new length, so
torch's styles (``compute="dtensor"``, kept as the reference) pay a fake-tensor propagation in
every op of every layer of every micro-batch (benchmarks/bench_tp_dispatch.py). The embedding
keeps torch's vocabulary-parallel style (one lookup per micro-batch).

HF transformers models use their own plans (:func:`hf_tensor_parallel`: the model's ``tp_plan``,
applied by transformers).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from .llama import Llama, RMSNorm, rms_norm
from .moe import MoE
from .tp_ops import (copy_to_tp, gather_rows, local_tensor, reduce_from_tp, scatter_rows,  # noqa: F401
                     shared_kv, slice_rows)  # local_tensor, shared_kv re-exported: the model's TP pieces

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


class _LocalStyle(ParallelStyle):
    """A style of the local plan: the module's parameters become DTensors on the TP mesh (the
    placements below; FSDP2, checkpoints and the gradient norm see the same parameters as under
    torch's styles), and its forward computes on their local shards with plain tensors and the
    TP collectives of ``tp_ops`` (autograd functions), never through DTensor dispatch."""

    kinds: Tuple[type, ...] = (nn.Linear,)

    def _placements(self, module: nn.Module) -> Dict[str, Any]:
        return {}

    @abstractmethod
    def _forward(self, module: nn.Module, group, tp: int, index: int) -> Callable[..., torch.Tensor]:
        """The module's forward on local shards (each style's own)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, self.kinds):
            raise TypeError(f"{type(self).__name__} applies to {[k.__name__ for k in self.kinds]}, "
                            f"got {type(module).__name__}")
        placements = self._placements(module)
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                dt = distribute_tensor(p.data, device_mesh, [placements.get(name, Replicate())])
                module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        module.forward = self._forward(module, device_mesh.get_group(), device_mesh.size(),
                                       device_mesh.get_local_rank())
        return module


def _bias(module: nn.Module) -> Optional[torch.Tensor]:
    return None if module.bias is None else local_tensor(module.bias)


class LocalColwise(_LocalStyle):
    """Column-parallel ``nn.Linear`` (weight and bias ``Shard(0)``): output features split over TP,
    local output. ``sum_input_grad``: the input's gradient is summed over TP here (its consumer
    alone); otherwise the module's caller prepared the input (:class:`LocalInput`)."""

    def __init__(self, *, sum_input_grad: bool = False) -> None:
        super().__init__()
        self.sum_input_grad = sum_input_grad

    def _placements(self, module):
        return {"weight": Shard(0), "bias": Shard(0)}

    def _forward(self, module, group, tp, index):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.sum_input_grad:
                x = copy_to_tp(x, group)
            return F.linear(x, local_tensor(module.weight), _bias(module))
        return forward


class LocalRowwise(_LocalStyle):
    """Row-parallel ``nn.Linear`` (weight ``Shard(1)``, bias replicated): the partial products
    summed over TP, whole (``sequence=False``) or this rank's rows of it (sequence parallelism)."""

    def __init__(self, *, sequence: bool = False) -> None:
        super().__init__()
        self.sequence = sequence

    def _placements(self, module):
        return {"weight": Shard(1), "bias": Replicate()}

    def _forward(self, module, group, tp, index):
        def forward(x: torch.Tensor) -> torch.Tensor:
            y = F.linear(x, local_tensor(module.weight))
            y = scatter_rows(y, group, tp, index) if self.sequence else reduce_from_tp(y, group)
            b = _bias(module)
            if b is not None:
                y = y + (copy_to_tp(b, group) if self.sequence else b)
            return y
        return forward


class LocalReplicate(_LocalStyle):
    """A module every TP rank computes whole (parameters replicated): a norm, the MoE router. On
    this rank's rows under sequence parallelism (``sequence=True``): the parameters' gradients are
    then summed over TP."""

    kinds = (nn.Linear, RMSNorm)

    def __init__(self, *, sequence: bool = False) -> None:
        super().__init__()
        self.sequence = sequence

    def _forward(self, module, group, tp, index):
        def param(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if p is None:
                return None
            p = local_tensor(p)
            return copy_to_tp(p, group) if self.sequence else p

        if isinstance(module, RMSNorm):
            return lambda x: rms_norm(x, param(module.weight), module.eps)
        return lambda x: F.linear(x, param(module.weight), param(module.bias))


class _Tokens:
    """The micro-batch's token count where a hook needs it under sequence parallelism (local rows
    do not tell it): set by a pre-hook of the enclosing block or model from its ``position_ids``
    (or ``input_ids``), on every call (activation checkpointing's recompute included)."""

    def __init__(self) -> None:
        self.n = -1

    def get(self, who: str) -> int:
        if self.n < 0:
            raise RuntimeError(f"tensor parallelism: {who} ran outside its block (no token count)")
        return self.n


def _count_tokens(holder: _Tokens, with_input_ids: bool = False):
    """A forward pre-hook (with kwargs) that sets ``holder`` from the call's ``position_ids``
    (argument 1), else (``with_input_ids``) its ``input_ids`` (argument 0)."""

    def hook(module, args, kwargs):
        ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if ids is None and with_input_ids:
            ids = args[0] if args else kwargs.get("input_ids")
        holder.n = -1 if ids is None else int(ids.shape[0])
    return hook


def _prepare_input(module: nn.Module, group, tp: int, index: int, sequence: bool, partial: bool,
                   tokens: Callable[[tuple], int], slice_output: bool = False) -> None:
    """The input of a module whose layers split over TP (attention, MLP, MoE, LM head): whole on
    every rank (the sequence's rows all-gathered under sequence parallelism), its gradient summed
    over TP on the way back where the module's layers each cover a share (``partial``), and,
    with ``slice_output``, the module's first output cut back to this rank's rows."""

    def pre(mod, args):
        x = args[0]
        if sequence:
            x = gather_rows(x, tokens(args), group, tp, index, partial)
        elif partial:
            x = copy_to_tp(x, group)
        return (x,) + tuple(args[1:])

    module.register_forward_pre_hook(pre)
    if slice_output:
        def post(mod, args, out):
            if isinstance(out, tuple):
                return (slice_rows(out[0], group, tp, index),) + tuple(out[1:])
            return slice_rows(out, group, tp, index)
        module.register_forward_hook(post)


def _local_plan(model: Llama, tp_mesh, sp: bool, loss_parallel: bool) -> None:
    """The local plan (:func:`tensor_parallel`, ``compute="local"``)."""
    cfg = model.cfg
    tp, t, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    share = tp > cfg.n_kv_heads
    if model.embed is not None:  # one lookup per micro-batch: torch's vocabulary-parallel style
        parallelize_module(model, tp_mesh, {"embed": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate(), use_local_output=True)})
    model_tokens = _Tokens()
    model.register_forward_pre_hook(_count_tokens(model_tokens, with_input_ids=True), with_kwargs=True)
    if model.norm is not None:
        LocalReplicate(sequence=sp)._apply(model.norm, tp_mesh)
    if model.lm_head is not None:
        head = model.lm_head
        LocalColwise()._apply(head, tp_mesh)
        _prepare_input(head, group, tp, t, sp, True, lambda args: model_tokens.get("the LM head"))
        vocab = head.weight.shape[0]

        def logits(mod, args, y):
            d = DTensor.from_local(y, tp_mesh, [Shard(-1)], run_check=False, shape=(y.shape[0], vocab),
                                   stride=(vocab, 1))
            return d if loss_parallel else d.full_tensor()
        head.register_forward_hook(logits)
    for block in model.layers.values():
        tokens = _Tokens()
        block.register_forward_pre_hook(_count_tokens(tokens), with_kwargs=True)
        attn = block.attn
        for norm in (block.attn_norm, block.mlp_norm):
            LocalReplicate(sequence=sp)._apply(norm, tp_mesh)
        _prepare_input(attn, group, tp, t, sp, True, lambda args: int(args[1].shape[0]))
        attn.tp_input_prepared = True
        LocalColwise()._apply(attn.wq, tp_mesh)
        LocalRowwise(sequence=sp)._apply(attn.wo, tp_mesh)
        if share:
            for lin in (attn.wk, attn.wv):  # parameters only: shared_kv computes the rank's head
                distribute_module(lin, tp_mesh, _replicate_params)
            attn.kv_share = (t // (tp // cfg.n_kv_heads), group)
            attn.n_kv_heads = 1
        else:
            LocalColwise()._apply(attn.wk, tp_mesh)
            LocalColwise()._apply(attn.wv, tp_mesh)
            attn.n_kv_heads = cfg.n_kv_heads // tp
        attn.n_heads = cfg.n_heads // tp
        moe = getattr(block, "moe", None)
        if isinstance(moe, MoE):
            # the router computes whole on every rank: the input's gradient is complete where it
            # leaves the MoE, so each expert's column-parallel layers sum their own share
            _prepare_input(moe, group, tp, t, sp, False, lambda args, n=tokens: n.get("the MoE"),
                           slice_output=sp)
            LocalReplicate()._apply(moe.router, tp_mesh)
            for _, expert in moe.local_experts():  # this rank's under expert parallelism
                LocalColwise(sum_input_grad=True)._apply(expert.w1, tp_mesh)
                LocalColwise(sum_input_grad=True)._apply(expert.w3, tp_mesh)
                LocalRowwise()._apply(expert.w2, tp_mesh)
        else:
            mlp = block.mlp
            _prepare_input(mlp, group, tp, t, sp, True, lambda args, n=tokens: n.get("the MLP"))
            LocalColwise()._apply(mlp.w1, tp_mesh)
            LocalColwise()._apply(mlp.w3, tp_mesh)
            LocalRowwise(sequence=sp)._apply(mlp.w2, tp_mesh)


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
                    loss_parallel: bool = True, compute: str = "local") -> nn.Module:
    """Apply the TP plan (module docstring) to the package's Llama in place; returns it.

    ``loss_parallel``: the logits come back as a DTensor sharded over the vocabulary; compute the
    loss (and run backward) inside ``torch.distributed.tensor.parallel.loss_parallel()``
    (the step executor does). ``compute``: ``"local"`` (default: the layers compute on plain
    tensors, module docstring) or ``"dtensor"`` (torch's styles: every op through DTensor
    dispatch; the same parameters and results). Raises ValueError when the TP degree does not
    fit the heads or ``compute`` is unknown.
    """
    if compute not in ("local", "dtensor"):
        raise ValueError(f"tensor_parallel: compute must be 'local' or 'dtensor', got {compute!r}")
    if not isinstance(model, Llama):
        raise TypeError(f"tensor_parallel: expected bytescale.models.Llama, got {type(model).__name__} "
                        "(HF models: hf_tensor_parallel)")
    cfg = model.cfg
    tp = tp_mesh.size()
    check_tensor_parallel(cfg.n_heads, cfg.n_kv_heads, tp, "this Llama")
    if tp == 1:
        return model
    if getattr(model, "tp_mesh", None) is not None:
        raise RuntimeError("tensor_parallel: this Llama is already tensor-parallel (its heads and layers are "
                           "split); apply the plan once, to the model as a single process builds it")
    sp = bool(sequence_parallel)
    model.tp_mesh = tp_mesh
    model.sequence_parallel = sp
    model.loss_parallel = bool(loss_parallel) and model.lm_head is not None
    model.tp_compute = compute
    if compute == "local":
        _local_plan(model, tp_mesh, sp, bool(loss_parallel))
        return model
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
    # with pipelines, the hidden states crossing a stage boundary are this rank's sequence shard
    # (Llama.forward wraps a received one back into a DTensor; the stage I/O sends the local part)
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
