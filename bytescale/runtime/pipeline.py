"""Pipeline parallelism under HDP: one stage's part of each step, 1F1B over the plan's slots.

    mesh = bytescale.init_mesh(pp=2)                       # pp x hdp (x tp) ranks
    model = Llama(cfg).pipeline_stage(mesh.stage, mesh.pp) # the whole model's init, then its stage
    hdp = HybridDataParallel(model, process_group=mesh.group("hdp"))
    loader = HDPLoader(..., PlannerConfig(capacity=.., strategy="pp-balance", pp=2), ..., units=mesh)
    executor = PipelineExecutor(hdp, mesh=mesh)
    for step in loader:
        out = executor.run(step)                           # out.loss: the last stage's

Each pipeline (HDP unit ``h`` of every stage) runs its unit's micro-batches; the plan gives each a
SLOT (``Plan.micro_batch_slots``), and every stage walks the 1F1B order of its pipeline's slots
(``csrc/planner/pipeline.h``: ``w = min(P - 1 - p, S)`` warm-up forwards, then one forward and one
backward in turn, then the cool-down backwards; empty slots skipped). A ring micro-batch of ``d``
pipelines runs at every stage on those pipelines' units at the same slot, so its ring attention
meets its members at the same point of their 1F1B orders; the planner's replay
(``plan.makespan``) is this schedule.

Transfers. Stage ``p`` sends a micro-batch's output (hidden states ``(T, dim)``) to ``p + 1`` on the
boundary's forward channel and receives the gradient of it on the backward channel
(:meth:`bytescale.Mesh.p2p_group`: one static two-rank group per boundary and direction). Both
ends list the transfers of a channel in slot order, so a transfer is matched with its receive
whatever the micro-batch counts of the pipelines, and a send that waits for its receiver (NCCL)
holds up only later sends of its own channel. Shapes are not exchanged: ``T`` is the micro-batch's
token count on this unit, which every stage derives from the same plan (the loader's plan check
compares the plans of all ranks), and the dtype is the model's.

Why it cannot hang: the 1F1B order of ``S`` slots is a subsequence of that of any ``S' >= S``, so
every stage's operations embed in one canonical pipeline's acyclic dependency graph, and a ring
joins operations of the same (stage, direction, slot). Sends are asynchronous and waited for at
the end of the step.

Why not ``torch.distributed.pipelining``: its stages take one activation shape (inferred once, or
given) for every micro-batch, while here each micro-batch has its own token count; its schedules
give every pipeline the same number of micro-batches and know nothing of a ring that joins stages
of several pipelines at one slot; and it sends both directions over one group. Its 1F1B order is
the one used here (``csrc/planner/pipeline.h``), over the plan's slots.

Loss: the last stage computes the token-level loss over the global batch (and the model's MoE
balance loss where a stage has MoE layers: each stage adds its own), so the gradients equal
single-process training on the same global batch; :class:`StepOutput.loss` is the last stage's
share (0 on other stages). Gradients are summed over the stage's HDP group (``HybridDataParallel``
with ``process_group=mesh.group("hdp")``).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..attention.layout import Layout
from .executor import StepOutput, check_plan_dims
from .loss import token_level_loss
from .parallel import HybridDataParallel
from .types import MicroBatch, Step

__all__ = ["PipelineExecutor", "pipeline_order"]


def pipeline_order(slots: List[int], stages: int, stage: int) -> List[Tuple[str, int]]:
    """The operations of one stage: ``("F", k)`` / ``("B", k)`` for the micro-batch at position
    ``k`` of a pipeline whose micro-batches hold ``slots`` (increasing; gaps are empty slots), in
    1F1B order (``csrc/planner/pipeline.h``)."""
    from .. import _C

    if any(b <= a for a, b in zip(slots, slots[1:])) or any(s < 0 for s in slots):
        raise ValueError(f"pipeline_order: slots must be increasing and >= 0, got {slots}")
    if not slots:
        return []
    at = {s: k for k, s in enumerate(slots)}
    out = []
    for op in _C.planner.one_f_one_b(slots[-1] + 1, stages, stage):
        k = at.get(op // 2)
        if k is not None:
            out.append(("B" if op % 2 else "F", k))
    return out


@dataclass
class _Held:
    """A micro-batch between its forward and its backward on this stage."""

    inp: Optional[torch.Tensor]     # the received hidden states (a leaf; None on the first stage)
    out: torch.Tensor               # the stage's output (last stage: the objective)
    aux: Optional[torch.Tensor]     # this stage's MoE balance loss (before the last stage)
    loss: float
    aux_value: float
    layout: Layout


class PipelineExecutor:
    """Runs HDP steps on one pipeline stage (module docstring).

    Args:
        model: the stage, wrapped: a :class:`HybridDataParallel` over bytescale's
            :class:`~bytescale.models.Llama` cut by :meth:`~bytescale.models.Llama.pipeline_stage`
            (tensor-parallel inside it or not), summing gradients over ``mesh.group("hdp")``.
        mesh: the job's :class:`bytescale.Mesh` with ``pp`` > 1 (default: the current one).
        autocast: a context manager factory for the forward (e.g. bf16 autocast), or None.
    """

    def __init__(self, model: HybridDataParallel, mesh: Any = None,
                 autocast: Optional[Callable[[], Any]] = None) -> None:
        from ..comm.mesh import current_mesh
        from ..models.llama import Llama

        if not isinstance(model, HybridDataParallel):
            raise TypeError(f"PipelineExecutor: expected a bytescale.HybridDataParallel, got {type(model).__name__}")
        self.mesh = mesh if mesh is not None else current_mesh()
        if self.mesh is None or self.mesh.pp < 2:
            raise ValueError("PipelineExecutor: needs a mesh with pp > 1 (bytescale.init_mesh(pp=P)); "
                             "without pipelines use StepExecutor")
        if getattr(self.mesh, "ep", 1) > 1:  # as the trainer refuses --pp with --ep (TrainConfig)
            raise ValueError(f"PipelineExecutor: expert parallelism (mesh ep={self.mesh.ep}) is not supported with "
                             "pipelines: stages are replicated over their HDP group, and EP's lockstep slots "
                             "and all-to-alls are not scheduled across pipeline stages; use ep=1 with pp > 1")
        stage_model = model.module
        if not isinstance(stage_model, Llama):
            raise TypeError(f"PipelineExecutor: the stage must be bytescale's Llama (Llama.pipeline_stage), got "
                            f"{type(stage_model).__name__}")
        self.stage, self.stages = self.mesh.stage, self.mesh.pp
        if (stage_model.stage, stage_model.stages) != (self.stage, self.stages):
            raise ValueError(f"PipelineExecutor: rank {self.mesh.rank} is stage {self.stage} of {self.stages}, but its "
                             f"model is stage {stage_model.stage} of {stage_model.stages}; call "
                             f"model.pipeline_stage(mesh.stage, mesh.pp)")
        if model.process_group is None or model.fsdp:
            raise ValueError("PipelineExecutor: sum the stage's gradients over its HDP group: "
                             "HybridDataParallel(stage, process_group=mesh.group('hdp'))")
        self.model = model
        self.module = stage_model
        self.autocast = autocast
        self.loss_parallel = bool(getattr(stage_model, "loss_parallel", False))
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        p = next(stage_model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.dim = stage_model.cfg.dim
        self._sends: List[Any] = []
        self._waited = 0.0

    # -- the schedule ----------------------------------------------------------------------------
    def run(self, step: Step) -> StepOutput:
        """This stage's part of ``step``: the 1F1B order of its pipeline's slots, then the
        gradient sum over the stage's HDP group."""
        slots = self._check(step)
        order = pipeline_order(slots, self.stages, self.stage)
        held: Dict[int, _Held] = {}
        loss = aux = 0.0
        self._waited = 0.0
        t0 = time.perf_counter()
        n_back = 0
        try:
            for kind, k in order:
                mb = step.micro_batches[k]
                if kind == "F":
                    held[k] = self._forward(step, k, mb)
                else:
                    n_back += 1
                    h = held.pop(k)
                    self._backward(step, k, mb, h, last=n_back == len(step.micro_batches))
                    loss += h.loss
                    aux += h.aux_value
            t1 = time.perf_counter()
            for w in self._sends:
                w.wait()
            self._waited += time.perf_counter() - t1
        finally:
            self._sends = []
        self.model.finish_step()
        # compute_s: the time inside this stage's operations (receives and send completions
        # excluded), so that 1 - compute / step over all ranks is the measured bubble
        busy = time.perf_counter() - t0 - self._waited
        return StepOutput(loss, aux, busy, sum(1 for m in step.micro_batches if m.num_tokens))

    def _forward(self, step: Step, k: int, mb: MicroBatch) -> _Held:
        T = mb.num_tokens
        inp = None
        if not self.first:
            inp = self._recv((T, self.dim), ("fwd", self.stage - 1), self.stage - 1, step, k, "activations")
            inp.requires_grad_(True)
        layout = mb.layout
        pos = mb.position_ids.to(self.device, non_blocking=True)
        with self.model.forward_scope(mb, layout=layout), self._loss_scope():
            with (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
                ids = mb.input_ids.to(self.device, non_blocking=True) if self.first else None
                out, a = self.module(ids, pos, layout=layout, global_tokens=step.global_tokens,
                                     return_aux=True, hidden=inp)
                if self.last:
                    lo = token_level_loss(out, mb.labels.to(out.device), step.global_loss_tokens)
            if self.last:
                if hasattr(lo, "to_local"):  # vocabulary-parallel loss: the same value on every TP rank
                    lo = lo.to_local()
                objective = lo + a
                return _Held(inp, objective, None, float(lo.detach()), float(a.detach()), layout)
        self._send(out.detach().to(self.dtype), ("fwd", self.stage), self.stage + 1)
        return _Held(inp, out, a if a.requires_grad else None, 0.0, float(a.detach()), layout)

    def _backward(self, step: Step, k: int, mb: MicroBatch, h: _Held, last: bool) -> None:
        with self.model.backward_scope(mb, last=last, layout=h.layout), self._loss_scope():
            if self.last:
                h.out.backward()
            else:
                g = self._recv(tuple(h.out.shape), ("bwd", self.stage), self.stage + 1, step, k, "gradients")
                outs, grads = [h.out], [g.to(h.out.dtype)]
                if h.aux is not None:
                    outs.append(h.aux)
                    grads.append(torch.ones_like(h.aux))
                torch.autograd.backward(outs, grads)
        if not self.first:
            grad = h.inp.grad if h.inp.grad is not None else torch.zeros_like(h.inp)
            self._send(grad.to(self.dtype), ("bwd", self.stage - 1), self.stage - 1)

    # -- transfers -------------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        c = self.mesh.coords()
        return self.mesh.grid[stage][c["hdp"]][c["tp"]]

    def _send(self, t: torch.Tensor, channel: Tuple[str, int], stage: int) -> None:
        t = t.contiguous()
        self._sends.append(dist.isend(t, dst=self._peer(stage), group=self.mesh.p2p_group(*channel)))

    def _recv(self, shape, channel: Tuple[str, int], stage: int, step: Step, k: int, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        peer = self._peer(stage)
        t0 = time.perf_counter()
        try:
            dist.recv(buf, src=peer, group=self.mesh.p2p_group(*channel))
            self._waited += time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - re-raised with the schedule's position
            raise RuntimeError(
                f"PipelineExecutor: stage {self.stage} (rank {self.mesh.rank}) step {step.index}: receiving the "
                f"{what} of micro-batch {k} ({shape[0]} tokens) from stage {stage} (rank {peer}) failed: {e}") from e
        return buf

    # -- checks ----------------------------------------------------------------------------------
    def _check(self, step: Step) -> List[int]:
        if not isinstance(step, Step):
            raise TypeError(f"PipelineExecutor: expected a bytescale Step, got {type(step).__name__}")
        plan = step.plan
        if plan is None:
            raise ValueError(f"PipelineExecutor: step {step.index} carries no plan")
        try:
            plan.check_pp(self.stages)
        except ValueError as e:
            raise ValueError(f"PipelineExecutor: step {step.index}: {e}") from None
        check_plan_dims(step, self.mesh, "PipelineExecutor")
        units = getattr(plan, "units", None)
        if units is not None and units != self.mesh.units:
            raise ValueError(f"PipelineExecutor: step {step.index} was planned for {units.describe()}, but stage "
                             f"{self.stage}'s units are {self.mesh.units.describe()}; build the loader with units=mesh")
        slots = plan.micro_batch_slots(self.mesh.rank)
        if len(slots) != len(step.micro_batches):
            raise ValueError(f"PipelineExecutor: step {step.index} has {len(step.micro_batches)} micro-batches on rank "
                             f"{self.mesh.rank}, its plan {len(slots)} slots (a lockstep loader? pipelines take the "
                             "plan's own micro-batches)")
        return slots

    def _loss_scope(self):
        if not (self.loss_parallel and self.last):
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
