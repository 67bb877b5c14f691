"""The step executor: one class runs every schedule (HDP, FSDP2 / EP lockstep, 1F1B pipelines).

    executor = StepExecutor(model)                  # model: a HybridDataParallel (a stage of it with pp > 1)
    for step in loader:
        out = executor.run(step)                    # the schedule's operations, then gradient sync
        clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()

The executor decides the schedule's kind once, from the mesh and the model
(:func:`bytescale.runtime.schedule.schedule_kind`), and each step builds the rank's operations from
the step's plan (:func:`~bytescale.runtime.schedule.build_schedule`): flat, lockstep with its
padding entries, or 1F1B. The loader delivers the plan's own micro-batches; the schedule decides
which run when. A stage I/O object (:mod:`bytescale.runtime.stage_io`) gives what differs by
pipeline stage: the first stage embeds tokens, others receive hidden states; the last computes
the loss, others send. ``run`` is ``start``, the operations, ``finish``; a caller may drive the
phases itself (``forward(j)`` / ``backward(j)`` over the schedule's positions).

What the executor owns, per micro-batch: its layout (entered in both of its phases: activation
checkpointing recomputes the forward inside backward), the plan's offload ratio (forward), the
vocabulary-parallel loss of a tensor-parallel model (both phases on the last stage), autocast
(forward), the token-level loss over the global batch plus the MoE balance loss, and gradient
synchronisation (started by the rank's last backward, finished by :meth:`finish`). It checks that
the step was planned for this rank's mesh and, for schedules whose forwards hold collectives
(lockstep), that every rank can run it (all raise together, never a hang).

Loss: the last stage computes the token-level loss over the global batch (and each stage its MoE
balance loss), so the gradients equal single-process training on the same global batch;
:attr:`StepOutput.loss` is this rank's share (0 before the last stage).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..attention.layout import Layout
from .loss import token_level_loss
from .parallel import HybridDataParallel
from .schedule import FLAT, Schedule, build_schedule, schedule_kind
from .stage_io import stage_io, takes_layout
from .types import MicroBatch, Step

__all__ = ["StepExecutor", "StepOutput", "ForwardFn", "default_forward", "check_plan_dims"]

ForwardFn = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]
"""``forward(module, mb, step, hidden=None) -> (out, aux loss or None)``: ``out`` the logits (T, V)
on the last stage, the hidden states before it; ``hidden`` the previous stage's output (pipelines
only: a custom forward without pipelines is called without it)."""


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


def default_forward(module: torch.nn.Module, mb: MicroBatch, step: Step, hidden: Optional[torch.Tensor] = None):
    """A stage model (bytescale's Llama: ``layout=``, ``hidden=``, the MoE balance loss;
    :mod:`bytescale.runtime.stage_io`) or an HF causal LM (its attention reads the current
    layout; a zero-token padding entry runs one dummy token, under the one-token layout the
    executor gives it, whose logits count 0)."""
    dev = _device_of(getattr(module, "module", module))
    pos = mb.position_ids.to(dev, non_blocking=True)
    if takes_layout(module):
        ids = None if hidden is not None else mb.input_ids.to(dev, non_blocking=True)
        return module(ids, pos, layout=mb.layout, global_tokens=step.global_tokens, return_aux=True, hidden=hidden)
    ids = mb.input_ids.to(dev, non_blocking=True)
    if ids.numel() == 0:
        out = module(input_ids=ids.new_zeros(1, 1), position_ids=pos.new_zeros(1, 1), use_cache=False)
        return out.logits[0, :0] + out.logits.sum() * 0, None
    out = module(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    return out.logits[0], None


@dataclass(frozen=True)
class StepOutput:
    """What a step left on this rank: its loss (the token-level loss of this rank's micro-batches,
    summed; the global batch's loss is the sum over HDP units; 0 before a pipeline's last stage),
    the MoE balance loss, the time inside the schedule's operations (receives and send
    completions excluded, so that 1 - compute / step over the ranks is the measured bubble) and
    how many micro-batches held tokens."""

    loss: float
    aux: float
    compute_s: float
    micro_batches: int


@dataclass
class _Held:
    """A micro-batch between its forward and its backward."""

    inp: Optional[torch.Tensor]     # the received hidden states (a leaf; None on the first stage)
    out: torch.Tensor               # the objective (last stage) or the stage's output
    aux: Optional[torch.Tensor]     # before the last stage: this stage's MoE balance loss
    loss: float
    aux_value: float
    layout: Layout


def _empty(mb_plan) -> MicroBatch:
    """A padding entry's micro-batch: no token (it still joins its block's collectives)."""
    e = torch.empty(0, dtype=torch.long)
    return MicroBatch(e, e.clone(), e.clone(), plan=mb_plan, layout=mb_plan.layout())


class StepExecutor:
    """Runs steps of a :class:`HybridDataParallel` model under any schedule (module docstring).

    Args:
        model: the wrapped model (replicated parameters or FSDP2; tensor- or expert-parallel
            inside it; one pipeline stage when the mesh has ``pp`` > 1).
        forward: ``forward(module, mb, step, hidden=None) -> (out, aux)`` (default
            :func:`default_forward`).
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
        self.kind = schedule_kind(self.mesh, model)
        self.io = stage_io(model, self.mesh)
        self.loss_parallel = bool(getattr(model.module, "loss_parallel", False))
        self._step: Optional[Step] = None
        self._schedule: Optional[Schedule] = None
        self._mbs: Tuple[MicroBatch, ...] = ()
        self._held: Dict[int, _Held] = {}
        self._done: set = set()
        self._loss = self._aux = self._compute = 0.0

    @property
    def rank(self) -> int:
        if self.mesh is not None:
            return int(self.mesh.rank)
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def schedule(self) -> Optional[Schedule]:
        """The current step's schedule (None between steps)."""
        return self._schedule

    # -- phases ----------------------------------------------------------------------------------
    def start(self, step: Step) -> Schedule:
        """Begin ``step``: check it and build this rank's schedule (returned)."""
        if self._step is not None:
            raise RuntimeError(f"StepExecutor: step {self._step.index} is not finished; call finish() first")
        if not isinstance(step, Step):
            raise TypeError(f"StepExecutor: expected a bytescale Step, got {type(step).__name__}")
        self._check_plan(step)
        sched = self._build(step)
        self._mbs = tuple(_empty(e) if s < 0 else
                          (step.micro_batches[s] if e is step.micro_batches[s].plan
                           else replace(step.micro_batches[s], plan=e))
                          for e, s in zip(sched.entries, sched.source))
        self._step, self._schedule = step, sched
        self._held.clear()
        self._done = set()
        self._loss = self._aux = self._compute = 0.0
        self.io.waited = 0.0
        return sched

    def forward(self, j: int) -> float:
        """Forward of the schedule's entry ``j``; returns its token-level loss (0 before the last stage)."""
        step, mb = self._current(j, "forward")
        if j in self._held or j in self._done:
            raise RuntimeError(f"StepExecutor: micro-batch {j} of step {step.index} already ran its forward")
        t0, w0 = time.perf_counter(), self.io.waited
        inp = self.io.receive_forward((mb.num_tokens,), self._where(step, j))
        layout = self._layout(mb)
        with self.model.forward_scope(mb, layout=layout), self._loss_scope():
            with (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
                out, aux = (self.forward_fn(self.model, mb, step) if inp is None else
                            self.forward_fn(self.model, mb, step, hidden=inp))
                if self.io.last:
                    loss = token_level_loss(out, mb.labels.to(out.device), step.global_loss_tokens)
            if self.io.last:
                if hasattr(loss, "to_local"):  # vocabulary-parallel loss: the same value on every TP rank
                    loss = loss.to_local()
                held = _Held(inp, loss if aux is None else loss + aux, None, float(loss.detach()),
                             0.0 if aux is None else float(aux.detach()), layout)
        if not self.io.last:
            if hasattr(out, "to_local"):  # sequence parallelism: this TP rank's rows cross the boundary
                out = out.to_local()
            self.io.send_forward(out)
            grad_aux = aux if aux is not None and aux.requires_grad else None
            held = _Held(inp, out, grad_aux, 0.0, 0.0 if aux is None else float(aux.detach()), layout)
        self._compute += time.perf_counter() - t0 - (self.io.waited - w0)
        self._held[j] = held
        return held.loss

    def backward(self, j: int) -> None:
        """Backward of the schedule's entry ``j``; the rank's last backward starts gradient sync."""
        step, mb = self._current(j, "backward")
        h = self._held.pop(j, None)
        if h is None:
            raise RuntimeError(f"StepExecutor: micro-batch {j} of step {step.index} has no forward to go back through")
        t0, w0 = time.perf_counter(), self.io.waited
        last = len(self._done) + 1 == len(self._mbs)
        with self.model.backward_scope(mb, last=last, layout=h.layout), self._loss_scope():
            if self.io.last:
                h.out.backward()
            else:
                g = self.io.receive_backward(tuple(h.out.shape), self._where(step, j))
                outs, grads = [h.out], [g.to(h.out.dtype)]
                if h.aux is not None:
                    outs.append(h.aux)
                    grads.append(torch.ones_like(h.aux))
                torch.autograd.backward(outs, grads)
        if not self.io.first:
            self.io.send_backward(h.inp.grad if h.inp.grad is not None else torch.zeros_like(h.inp))
        self._compute += time.perf_counter() - t0 - (self.io.waited - w0)
        self._done.add(j)
        self._loss += h.loss
        self._aux += h.aux_value

    def finish(self) -> StepOutput:
        """Wait for this rank's sends and finish the step's gradient synchronisation (every rank,
        once per step)."""
        step = self._step
        if step is None:
            raise RuntimeError("StepExecutor.finish: no step was started")
        if self._held or len(self._done) != len(self._mbs):
            missing = sorted(set(range(len(self._mbs))) - self._done)
            raise RuntimeError(f"StepExecutor.finish: step {step.index} micro-batches {missing} did not run "
                               "forward and backward")
        try:
            self.io.wait_sends()
        finally:
            self._step, self._schedule = None, None
        t0 = time.perf_counter()
        self.model.finish_step()
        self._compute += time.perf_counter() - t0
        return StepOutput(self._loss, self._aux, self._compute, sum(1 for m in step.micro_batches if m.num_tokens))

    def run(self, step: Step) -> StepOutput:
        """``step`` under this rank's schedule: its operations in order, then :meth:`finish`."""
        sched = self.start(step)
        try:
            for kind, j in sched.ops:
                self.forward(j) if kind == "F" else self.backward(j)
        except BaseException:
            self._step, self._schedule = None, None
            raise
        return self.finish()

    # -- helpers ---------------------------------------------------------------------------------
    def _current(self, j: int, phase: str) -> Tuple[Step, MicroBatch]:
        step = self._step
        if step is None:
            raise RuntimeError(f"StepExecutor.{phase}: no step was started (call start(step))")
        if not 0 <= j < len(self._mbs):
            raise IndexError(f"StepExecutor.{phase}: micro-batch {j} outside [0, {len(self._mbs)}) of the "
                             f"schedule of step {step.index}")
        return step, self._mbs[j]

    def _where(self, step: Step, j: int) -> str:
        return f"step {step.index} micro-batch {j} (slot {self._mbs[j].plan.slot})"

    def _layout(self, mb: MicroBatch) -> Layout:
        """The micro-batch's layout; an HF model's zero-token padding entry runs one dummy token."""
        if mb.num_tokens == 0 and not takes_layout(self.model):
            return Layout.local([1])
        return mb.layout

    def _build(self, step: Step) -> Schedule:
        """This rank's schedule of the step; for lockstep every rank first agrees that it could
        build its own (one small all-reduce), so that a bad step raises everywhere."""
        mine = tuple(m.plan for m in step.micro_batches)
        if self.kind.kind == FLAT:
            return build_schedule(step.plan, self.rank, self.kind, mine)
        error = None
        try:
            if step.plan is None:
                raise ValueError("the step carries no plan")
            sched = build_schedule(step.plan, self.rank, self.kind, mine)
            want = step.plan.micro_batches(self.rank)
            if [(m.ring_id, tuple(d.batch_pos for d in m.documents)) for m in want] != \
                    [(m.ring_id, tuple(d.batch_pos for d in m.documents)) for m in mine]:
                raise ValueError(f"its {len(mine)} micro-batches are not the plan's {len(want)} (in the plan's "
                                 "order): run the loader's steps as they come")
        except ValueError as e:
            error = e
        if self.kind.kind != "1f1b":  # lockstep: the forwards hold collectives every rank must join
            import torch.distributed as dist

            flag = torch.tensor([0 if error is not None else 1], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if int(flag) == 0 and error is None:
                error = ValueError("another rank cannot run its schedule of this step")
        if error is not None:
            raise ValueError(f"StepExecutor: step {step.index} on rank {self.rank} ({self.kind.describe()}): "
                             f"{error}") from None
        return sched

    def _loss_scope(self):
        if not (self.loss_parallel and self.io.last):
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _check_plan(self, step: Step) -> None:
        check_plan_dims(step, self.mesh, "StepExecutor")
        plan_units = getattr(step.plan, "units", None)
        if self.mesh is None or plan_units is None:
            return
        mine = self.mesh.units
        if plan_units != mine:
            raise ValueError(f"StepExecutor: step {step.index} was planned for {plan_units.describe()}, but this "
                             f"rank's mesh has {mine.describe()}; build the loader with units=mesh (or "
                             "bytescale.init_mesh before it)")
