"""HybridDataParallel: the model replicated over every HDP rank, gradients synchronised once a step.

Under hybrid data parallelism each rank runs however many micro-batches the plan gives it (zero
included), accumulating gradients locally. On the LAST micro-batch's backward, gradient buckets
(DDP-style, in reverse parameter order) are all-reduced asynchronously as soon as they are
complete, overlapping the rest of that backward; :meth:`HybridDataParallel.finish_step` launches
what is left (a rank with no micro-batch contributes zeros), waits, and writes the summed gradients
back. Buckets always start in the same order on every rank, so the collectives match.

The overlap is kept only where the order of operations allows it. On CUDA the gradient
all-reduces and ring attention's exchanges run in issue order on ONE NCCL stream: when a rank's
last micro-batch is a ring that some member runs BEFORE other micro-batches, this rank would queue
the all-reduce between the ring's exchanges while that member queues it after its remaining
micro-batches, a cycle that deadlocks. The plan knows
(:attr:`~bytescale.planner.MicroBatchPlan.ring_is_last_on_all`); in that case the buckets start
after the backward, in :meth:`finish_step`. (A ring that is last on every member, or a local last
micro-batch, overlaps as before: every member then queues the buckets at the same points.)

The reduction is a SUM: combined with :func:`bytescale.runtime.token_level_loss` (divide by the global
number of loss tokens) the result equals single-device training on the global batch.

Expert parallelism (:func:`bytescale.models.expert_parallel`): the experts a rank keeps are summed
over their expert-data-parallel group (the ranks holding the same experts) in buckets of their own,
every other parameter over ``process_group`` as above.

Sharded parameters (FSDP2): wrap a model already passed through ``fully_shard``. Then FSDP2 does the
gradient reduce-scatter (as a SUM: the wrapper sets the gradient divide factor to 1) and gradient
sync is enabled on the last micro-batch only. FSDP2 all-gathers parameters in every forward, which
every rank must join, so every rank must run the SAME number of micro-batches: the step executor
runs a lockstep schedule for it (ranks with fewer run empty micro-batches, zero tokens). With
expert parallelism too (EP x FSDP2), ``fully_shard`` leaves the experts out
(``ignored_params=set(expert_param_groups(model))``, on every ``fully_shard`` call): FSDP2 shards and
reduce-scatters the dense parameters over its mesh, and the experts' gradients are summed over their
expert-data-parallel group in this wrapper's buckets, as without FSDP2. The world lockstep slots
also satisfy the EP all-to-alls (every rank runs every slot).

Usage::

    model = HybridDataParallel(model)
    for step in loader:                       # bytescale.data.HDPLoader
        mbs = step.micro_batches
        for i, mb in enumerate(mbs):
            with model.micro_batch(mb, last=(i == len(mbs) - 1)):   # plan's offload ratio, HF layout
                logits = model(mb.input_ids, mb.position_ids, layout=mb.layout)
                token_level_loss(logits, mb.labels, step.global_loss_tokens).backward()
        model.finish_step()
        opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..attention.api import micro_batch_context
from ..attention.layout import Layout
from ..comm.traffic import traffic_scope
from ..config import RuntimeConfig
from .types import MicroBatch
from .offload import offload

__all__ = ["HybridDataParallel"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (tensor-parallel parameters and gradients), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _same_layout(p: nn.Parameter) -> bool:
    """Whether ``p.grad`` is laid out like ``p`` (a tensor-parallel embedding's gradient comes back
    replicated while its weight is sharded)."""
    g = p.grad
    return not hasattr(p, "placements") or g is None or tuple(g.placements) == tuple(p.placements)


def _grad_local(p: nn.Parameter) -> torch.Tensor:
    """``p.grad``'s values for ``p``'s local shard (taken from a differently laid out gradient)."""
    g = p.grad
    if not _same_layout(p):
        g = g.redistribute(p.device_mesh, p.placements)
    return _local(g)


def _set_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    """``p.grad`` = ``g`` (a local tensor), wrapped like ``p`` when ``p`` is a DTensor."""
    if p.grad is not None and _same_layout(p):
        _local(p.grad).copy_(g)
    elif hasattr(p, "placements"):
        from torch.distributed.tensor import DTensor

        p.grad = DTensor.from_local(g.clone(), p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())
    else:
        p.grad = g.clone()


def _check_experts_unsharded(module: nn.Module, experts) -> None:
    """EP x FSDP2: the experts must be left out of ``fully_shard`` (their own group sums them)."""
    sharded = [n for n, p in module.named_parameters() if p in experts and hasattr(p, "placements")
               and any(getattr(pl, "is_shard", lambda: False)() for pl in p.placements)
               and p.device_mesh.mesh_dim_names != ("tp",)]
    if sharded:
        raise ValueError(f"HybridDataParallel: FSDP2 sharded the expert-parallel parameter {sharded[0]} (and "
                         f"{len(sharded) - 1} more); pass ignored_params=set(expert_param_groups(model)) to "
                         "every fully_shard call, so that the experts' gradients are summed over their "
                         "expert-data-parallel group")


@dataclass
class _Bucket:
    params: List[nn.Parameter]
    numel: int
    dtype: torch.dtype
    device: torch.device
    group: Optional[dist.ProcessGroup] = None
    ready: int = 0
    buffer: Optional[torch.Tensor] = None
    work: Optional[object] = None
    launched: bool = False
    offsets: List[int] = field(default_factory=list)


class HybridDataParallel(nn.Module):
    """Wrap ``module`` for HDP training (see module docstring).

    Args:
        module: the model (parameters replicated on every rank).
        process_group: the group gradients are summed over (default: the world).
        config: bucket size, initial parameter broadcast, offload threshold
            (:class:`~bytescale.config.RuntimeConfig`).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[dist.ProcessGroup] = None,
        config: Optional[RuntimeConfig] = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("HybridDataParallel: call dist.init_process_group first")
        self.config = config = config or RuntimeConfig()
        self.module = module
        self.process_group = process_group
        self._sync = False
        self._in_step = False
        self.fsdp = hasattr(module, "set_requires_gradient_sync") and hasattr(module, "set_gradient_divide_factor")
        from ..models.expert_parallel import expert_param_groups

        self._expert_groups = expert_param_groups(module)
        if self.fsdp:
            if process_group is not None:
                raise ValueError("HybridDataParallel: with FSDP2 the sharding mesh is the process group; "
                                 "do not pass process_group")
            _check_experts_unsharded(module, self._expert_groups)
            # token-level loss: sum, do not average (set on every FSDP module: it is per module)
            for m in module.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(1.0)
            # EP x FSDP2: FSDP2 left the experts out; they are this wrapper's (summed over the EDP group)
            params = [p for p in module.parameters() if p.requires_grad and p in self._expert_groups]
            bcast = params
        else:
            params = [p for p in module.parameters() if p.requires_grad]
            bcast = list(module.parameters()) + list(module.buffers())
        if not params and not self.fsdp:
            raise ValueError("HybridDataParallel: the module has no trainable parameters")
        if config.broadcast_parameters:
            with torch.no_grad():
                for t in bcast:
                    g = self._group_of(t)
                    dist.broadcast(_local(t.data), src=self._global_src(g), group=g)
        # DDP-style buckets in reverse registration order (roughly the order grads become ready).
        cap = max(1, int(config.bucket_cap_mb * 1024 * 1024))
        self._buckets: List[_Bucket] = []
        cur: List[nn.Parameter] = []
        cur_bytes = 0
        for p in reversed(params):
            n = _local(p).numel()
            if cur and (cur_bytes + n * p.element_size() > cap or p.dtype != cur[0].dtype
                        or p.device != cur[0].device or self._group_of(p) is not self._group_of(cur[0])):
                self._buckets.append(self._make_bucket(cur))
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += n * p.element_size()
        if cur:
            self._buckets.append(self._make_bucket(cur))
        self._bucket_of = {}
        for bi, b in enumerate(self._buckets):
            for p in b.params:
                self._bucket_of[p] = bi
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._next_launch = 0

    def _group_of(self, t: torch.Tensor) -> Optional[dist.ProcessGroup]:
        """The group ``t``'s gradient is summed over: an expert's expert-data-parallel group, else
        the HDP pool."""
        return self._expert_groups.get(t, self.process_group) if isinstance(t, nn.Parameter) else self.process_group

    @staticmethod
    def _global_src(group: Optional[dist.ProcessGroup]) -> int:
        if group is None:
            return 0
        return dist.get_global_rank(group, 0)

    def _make_bucket(self, params: List[nn.Parameter]) -> _Bucket:
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += _local(p).numel()
        return _Bucket(params=params, numel=n, dtype=params[0].dtype, device=params[0].device,
                       group=self._group_of(params[0]), offsets=offsets)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def micro_batch(self, mb: MicroBatch, last: bool = False,
                    offload_ratio: Optional[float] = None) -> Iterator[None]:
        """Run one micro-batch (forward AND backward inside the block).

        ``mb`` is the loader's :class:`~bytescale.data.MicroBatch`. Inside the block its layout is
        the current one (the fallback for models that cannot pass ``layout=`` to
        :func:`bytescale.attention.attention`, such as HF transformers models), and the share of
        its activations the plan chose (``PlannerConfig(offload=True)``, paper Eq. 3) moves to
        host memory during forward and returns for backward (:class:`bytescale.offload`;
        gradients unchanged); ``offload_ratio`` (0-1) overrides it. ``last=True`` on the rank's
        final micro-batch of the step: its backward starts the gradient all-reduce, bucket by
        bucket (unless it is a ring that another member does not run last: then
        :meth:`finish_step` starts it). The two halves are :meth:`forward_scope` and
        :meth:`backward_scope`, which a schedule that separates forward and backward
        (:class:`bytescale.runtime.StepExecutor`) enters one at a time.
        """
        with self.forward_scope(mb, offload_ratio), self.backward_scope(mb, last):
            yield

    @contextlib.contextmanager
    def forward_scope(self, mb: MicroBatch, offload_ratio: Optional[float] = None,
                      layout: Optional[Layout] = None) -> Iterator[None]:
        """The forward half of :meth:`micro_batch`: the micro-batch's layout (or ``layout``) is the
        current one and its activations are offloaded at the plan's ratio (``offload_ratio``
        overrides it)."""
        if not isinstance(mb, MicroBatch):
            raise TypeError(f"HybridDataParallel.micro_batch: expected the loader's bytescale.data.MicroBatch, "
                            f"got {type(mb).__name__}")
        ratio = float(mb.offload_ratio if offload_ratio is None else offload_ratio)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"HybridDataParallel.micro_batch: offload_ratio must be in [0, 1], got {ratio}")
        if not self._in_step:
            self._start_step()
        with contextlib.ExitStack() as stack:
            stack.enter_context(micro_batch_context(mb.layout if layout is None else layout))
            if ratio > 0.0:
                stack.enter_context(offload(ratio, seq_len=mb.num_tokens,
                                            min_bytes=self.config.offload_min_bytes))
            yield

    @contextlib.contextmanager
    def backward_scope(self, mb: MicroBatch, last: bool = False,
                       layout: Optional[Layout] = None) -> Iterator[None]:
        """The backward half of :meth:`micro_batch`: the micro-batch's layout is the current one
        (recomputation under activation checkpointing runs its forward again) and, when ``last``,
        its backward starts the gradient synchronisation (unless it is a ring that another member
        does not run last: then :meth:`finish_step` starts it, see the module docstring)."""
        if not self._in_step:
            self._start_step()
        # Overlap gradient sync with this backward unless a ring member still has micro-batches
        # after this ring (one NCCL stream per rank): then everything starts in finish_step().
        self._sync = last and (not mb.plan.is_ring or mb.plan.ring_is_last_on_all)
        if self.fsdp:
            self.module.set_requires_gradient_sync(last)
        try:
            with micro_batch_context(mb.layout if layout is None else layout):
                yield
        finally:
            self._sync = False

    def _start_step(self) -> None:
        self._in_step = True
        self._next_launch = 0
        for b in self._buckets:
            b.ready, b.work, b.launched, b.buffer = 0, None, False, None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        b = self._buckets[self._bucket_of[p]]
        b.ready += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        # Launch in bucket order only, so every rank issues the same collective sequence.
        while self._next_launch < len(self._buckets):
            b = self._buckets[self._next_launch]
            if not force and b.ready < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        buf = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        for p, off in zip(b.params, b.offsets):
            view = buf[off:off + _local(p).numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(_grad_local(p).reshape(-1))
        b.buffer = buf
        with traffic_scope("grad_sync"):  # counted as gradient sync (bytescale.comm.traffic)
            b.work = dist.all_reduce(buf, group=b.group, async_op=True)
        b.launched = True

    def finish_step(self) -> None:
        """Finish the step's gradient synchronisation (call once per step on every rank)."""
        if self.fsdp and not self._in_step:
            raise RuntimeError("HybridDataParallel (FSDP2): this rank ran no micro-batch; run the "
                               "step through bytescale.StepExecutor (its lockstep schedule)")
        if not self._in_step:
            self._start_step()  # a rank with no micro-batch this step
        self._launch_ready(force=True)
        for b in self._buckets:
            b.work.wait()
            for p, off in zip(b.params, b.offsets):
                lp = _local(p)
                _set_grad(p, b.buffer[off:off + lp.numel()].view_as(lp))
            b.buffer, b.work = None, None
        self._in_step = False
