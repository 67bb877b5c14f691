"""The step executor: one HDP step as phases that a schedule drives.

    executor = StepExecutor(model)                  # model: a HybridDataParallel
    for step in loader:
        out = executor.run(step)                    # forward, backward, finish
        clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()

``run`` is the plain HDP schedule: the micro-batches in the plan's order (the order the planner's
replay assumes: a ring starts when all its members reach it), each one's forward then backward.
A schedule that separates them (a pipeline's 1F1B) calls the phases itself::

    executor.start(step)
    executor.forward(0); executor.forward(1); executor.backward(0); ...
    out = executor.finish()

What the executor owns, per micro-batch: its layout (the micro-batch's own, entered in both of its
phases: activation checkpointing recomputes the forward inside backward), the plan's offload ratio
(forward), the vocabulary-parallel loss of a tensor-parallel model (both phases), bf16 autocast
(forward), the token-level loss over the global batch plus the MoE balance loss, and gradient
synchronisation (started by the backward of the rank's last micro-batch, finished by
:meth:`finish`). It checks that the step was planned for this rank's mesh.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..attention.layout import Layout
from .loss import token_level_loss
from .parallel import HybridDataParallel
from .types import MicroBatch, Step

__all__ = ["StepExecutor", "StepOutput", "ForwardFn", "default_forward"]

ForwardFn = Callable[[torch.nn.Module, MicroBatch, Step], Tuple[torch.Tensor, Optional[torch.Tensor]]]
"""``forward(module, mb, step) -> (logits (T, V), aux loss or None)``."""


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def check_plan_dims(step: Step, mesh, who: str) -> None:
    """A plan made from the job's ParallelDims (``bytescale.plan(lengths, dims, ...)``) must be run on
    a mesh laid out from the same sizes: world, pp, hdp, tp and ep compared."""
    dims, mine = getattr(getattr(step, "plan", None), "dims", None), getattr(mesh, "dims", None)
    if dims is None or mine is None:
        return
    if (dims.world, dims.pp, dims.hdp, dims.tp, dims.ep) != (mine.world, mine.pp, mine.hdp, mine.tp, mine.ep):
        raise ValueError(f"{who}: step {step.index} was planned for {dims.describe()} ({dims.world} ranks), but "
                         f"this rank's mesh is {mine.describe()} ({mine.world} ranks); plan with the mesh's dims")


def _is_llama(module: torch.nn.Module) -> bool:
    from ..models.llama import Llama

    return isinstance(getattr(module, "module", module), Llama)


def default_forward(module: torch.nn.Module, mb: MicroBatch, step: Step):
    """bytescale's Llama (``layout=``, the MoE balance loss) or an HF causal LM (its attention reads
    the current layout; a zero-token padding slot runs one dummy token, under the one-token layout
    the executor gives it, whose logits count 0)."""
    dev = _device_of(getattr(module, "module", module))
    ids = mb.input_ids.to(dev, non_blocking=True)
    pos = mb.position_ids.to(dev, non_blocking=True)
    if _is_llama(module):
        return module(ids, pos, layout=mb.layout, global_tokens=step.global_tokens, return_aux=True)
    if ids.numel() == 0:
        out = module(input_ids=ids.new_zeros(1, 1), position_ids=pos.new_zeros(1, 1), use_cache=False)
        return out.logits[0, :0] + out.logits.sum() * 0, None
    out = module(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    return out.logits[0], None


@dataclass(frozen=True)
class StepOutput:
    """What a step left on this rank: its loss (the token-level loss of this rank's micro-batches,
    summed; the global batch's loss is the sum over HDP units), the MoE balance loss, the time in
    the micro-batches' phases and how many held tokens."""

    loss: float
    aux: float
    compute_s: float
    micro_batches: int


@dataclass
class _Pending:
    objective: torch.Tensor
    loss: float
    aux: float


class StepExecutor:
    """Runs steps of a :class:`HybridDataParallel` model (module docstring).

    Args:
        model: the wrapped model (replicated parameters or FSDP2; tensor-parallel inside it).
        forward: ``forward(module, mb, step) -> (logits, aux)`` (default :func:`default_forward`).
        autocast: a context manager factory for the forward (e.g. bf16 autocast), or None.
        mesh: the job's :class:`bytescale.Mesh` (default: the current one); a step planned for
            other units raises.
    """

    def __init__(self, model: HybridDataParallel, forward: Optional[ForwardFn] = None,
                 autocast: Optional[Callable[[], Any]] = None, mesh: Any = None) -> None:
        if not isinstance(model, HybridDataParallel):
            raise TypeError(f"StepExecutor: expected a bytescale.HybridDataParallel, got {type(model).__name__}")
        from ..comm.mesh import current_mesh

        self.model = model
        self.forward_fn = forward or default_forward
        self.autocast = autocast
        self.mesh = mesh if mesh is not None else current_mesh()
        self.loss_parallel = bool(getattr(model.module, "loss_parallel", False))
        self._step: Optional[Step] = None
        self._pending: Dict[int, _Pending] = {}
        self._layouts: Dict[int, Layout] = {}  # each micro-batch's layout, for both of its phases
        self._done: set = set()
        self._loss = 0.0
        self._aux = 0.0
        self._compute = 0.0

    # -- phases ----------------------------------------------------------------------------------
    def start(self, step: Step) -> None:
        """Begin ``step`` (checks that it was planned for this rank's units)."""
        if self._step is not None:
            raise RuntimeError(f"StepExecutor: step {self._step.index} is not finished; call finish() first")
        if not isinstance(step, Step):
            raise TypeError(f"StepExecutor: expected a bytescale Step, got {type(step).__name__}")
        self._check_plan(step)
        self._step = step
        self._pending.clear()
        self._layouts.clear()
        self._done = set()
        self._loss = self._aux = self._compute = 0.0

    def forward(self, k: int) -> float:
        """Forward of micro-batch ``k`` (in the step's order); returns its token-level loss."""
        step, mb = self._current(k, "forward")
        if k in self._pending or k in self._done:
            raise RuntimeError(f"StepExecutor: micro-batch {k} of step {step.index} already ran its forward")
        t0 = time.perf_counter()
        self._layouts[k] = layout = self._layout(mb)
        with self.model.forward_scope(mb, layout=layout), self._loss_scope():
            with (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
                logits, aux = self.forward_fn(self.model, mb, step)
                labels = mb.labels.to(logits.device)
                loss = token_level_loss(logits, labels, step.global_loss_tokens)
            if hasattr(loss, "to_local"):  # vocabulary-parallel loss: the same value on every TP rank
                loss = loss.to_local()
            objective = loss if aux is None else loss + aux
        self._compute += time.perf_counter() - t0
        p = _Pending(objective, float(loss.detach()), 0.0 if aux is None else float(aux.detach()))
        self._pending[k] = p
        return p.loss

    def backward(self, k: int) -> None:
        """Backward of micro-batch ``k``; the rank's last micro-batch starts gradient sync."""
        step, mb = self._current(k, "backward")
        p = self._pending.pop(k, None)
        if p is None:
            raise RuntimeError(f"StepExecutor: micro-batch {k} of step {step.index} has no forward to go back through")
        t0 = time.perf_counter()
        last = len(self._done) + 1 == len(step.micro_batches)
        with self.model.backward_scope(mb, last=last, layout=self._layouts.pop(k)), self._loss_scope():
            p.objective.backward()
        self._compute += time.perf_counter() - t0
        self._done.add(k)
        self._loss += p.loss
        self._aux += p.aux

    def finish(self) -> StepOutput:
        """Finish the step's gradient synchronisation (every rank, once per step)."""
        step = self._step
        if step is None:
            raise RuntimeError("StepExecutor.finish: no step was started")
        if self._pending or len(self._done) != len(step.micro_batches):
            missing = sorted(set(range(len(step.micro_batches))) - self._done)
            raise RuntimeError(f"StepExecutor.finish: step {step.index} micro-batches {missing} did not run "
                               "forward and backward")
        t0 = time.perf_counter()
        self.model.finish_step()
        self._compute += time.perf_counter() - t0
        self._step = None
        return StepOutput(self._loss, self._aux, self._compute,
                          sum(1 for m in step.micro_batches if m.num_tokens))

    def run(self, step: Step) -> StepOutput:
        """The HDP schedule: every micro-batch's forward then backward, in the plan's order."""
        self.start(step)
        for k in range(len(step.micro_batches)):
            self.forward(k)
            self.backward(k)
        return self.finish()

    # -- helpers ---------------------------------------------------------------------------------
    def _current(self, k: int, phase: str) -> Tuple[Step, MicroBatch]:
        step = self._step
        if step is None:
            raise RuntimeError(f"StepExecutor.{phase}: no step was started (call start(step))")
        if not 0 <= k < len(step.micro_batches):
            raise IndexError(f"StepExecutor.{phase}: micro-batch {k} outside [0, {len(step.micro_batches)}) of "
                             f"step {step.index}")
        return step, step.micro_batches[k]

    def _layout(self, mb: MicroBatch) -> Layout:
        """The micro-batch's layout; an HF model's zero-token padding slot runs one dummy token."""
        if mb.num_tokens == 0 and not _is_llama(self.model):
            return Layout.local([1])
        return mb.layout

    def _check_ep_slots(self, step: Step, ep: int) -> None:
        """Expert parallelism: the step's micro-batches must be the plan's lockstep slots of this
        rank's EP group (every member the same number, rings in their common slot), or the
        all-to-alls would hang; a step laid out otherwise raises here on every rank (one small
        all-reduce of a flag), before the model's collectives."""
        try:
            want = step.plan.lockstep_micro_batches(self.mesh.rank, group=ep)
        except (AttributeError, ValueError) as e:
            raise ValueError(f"StepExecutor: step {step.index}: cannot check the expert-parallel slots ({e})") from None
        import torch.distributed as dist

        key = [(m.ring_id, tuple(d.batch_pos for d in m.documents)) for m in want]
        have = [(m.plan.ring_id, tuple(d.batch_pos for d in m.plan.documents)) for m in step.micro_batches]
        # agreed by every rank (one tiny all-reduce), so that all of them raise or none does
        flag = torch.tensor([1 if key == have else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag) == 0:
            where = "" if key != have else " on another rank"
            raise ValueError(
                f"StepExecutor: step {step.index}: with expert parallelism (ep={ep}) every rank of an EP group must "
                f"run the plan's lockstep slots ({len(want)} on rank {self.mesh.rank}, padding included), but the "
                f"step has {len(have)} micro-batches in another order{where}; build the loader with "
                f"LoaderConfig(lockstep=True, lockstep_group={ep}), or the all-to-alls would hang")

    def _loss_scope(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _check_plan(self, step: Step) -> None:
        check_plan_dims(step, self.mesh, "StepExecutor")
        plan_units = getattr(step.plan, "units", None)
        ep = int(getattr(getattr(self.model, "module", None), "ep_size", 1) or 1)
        if ep > 1 and step.plan is not None and self.mesh is not None:
            self._check_ep_slots(step, ep)
        if self.mesh is None or plan_units is None:
            return
        mine = self.mesh.units
        if plan_units != mine:
            raise ValueError(f"StepExecutor: step {step.index} was planned for {plan_units.describe()}, but this "
                             f"rank's mesh has {mine.describe()}; build the loader with units=mesh (or "
                             "bytescale.init_mesh before it)")
