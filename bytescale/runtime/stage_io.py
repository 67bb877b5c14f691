"""A stage's inputs and outputs: what differs between the first, a middle and the last pipeline stage.

:class:`~bytescale.runtime.StepExecutor` runs every schedule through one of these. Without
pipelines (:class:`WholeModel`) the rank is both first and last stage: it embeds the tokens and
computes the loss, and nothing crosses ranks. With pipelines (:class:`PipelineStage`) stage ``p``
receives a micro-batch's hidden states ``(T, hidden)`` from ``p - 1`` before its forward and sends
its output to ``p + 1`` after it; in backward it receives the gradient of its output from ``p + 1``
and sends the gradient of its input to ``p - 1``. A zero-token entry (lockstep padding) moves
nothing: both ends know its size from the plan.

Transfers run on :meth:`bytescale.Mesh.p2p_group` (one static two-rank group per boundary and
direction). Both ends list the transfers of a channel in slot order, so a transfer is matched with
its receive whatever the micro-batch counts of the pipelines, and a send that waits for its
receiver (NCCL) holds up only later sends of its own channel. Shapes are not exchanged: ``T`` is
the micro-batch's token count on this unit, which every stage derives from the same plan (the
loader's plan check compares the plans of all ranks), and the dtype is the model's. Sends are
asynchronous and waited for at the end of the step.

Why not ``torch.distributed.pipelining``: its stages take one activation shape (inferred once, or
given) for every micro-batch, while here each micro-batch has its own token count; its schedules
give every pipeline the same number of micro-batches and know nothing of a ring that joins stages
of several pipelines at one slot; and it sends both directions over one group. Its 1F1B order is
the one used here (``csrc/planner/pipeline.h``), over the plan's slots.

The stage model protocol (bytescale's :class:`~bytescale.models.Llama` and its
:meth:`~bytescale.models.Llama.pipeline_stage`): a class attribute ``takes_layout = True``;
attributes ``stage``, ``stages`` and ``hidden_size``; ``module(input_ids or None, position_ids,
layout=, global_tokens=, return_aux=True, hidden=None or (T, hidden_size))`` returns ``(out, aux)``:
logits ``(T, V)`` on the last stage, hidden states before it; ``aux`` the stage's MoE balance loss
(a scalar tensor).
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["WholeModel", "PipelineStage", "stage_io", "takes_layout"]


def takes_layout(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or the module a wrapper holds) implements the stage model protocol."""
    return bool(getattr(getattr(module, "module", module), "takes_layout", False))


class WholeModel:
    """No pipelines: first and last stage at once; no transfers."""

    first = last = True
    waited = 0.0

    def receive_forward(self, shape: Tuple[int, ...], where: str) -> Optional[torch.Tensor]:
        return None

    def send_forward(self, out: torch.Tensor) -> None:
        raise AssertionError("WholeModel has no next stage")

    def receive_backward(self, shape: Tuple[int, ...], where: str) -> torch.Tensor:
        raise AssertionError("WholeModel has no next stage")

    def send_backward(self, grad: torch.Tensor) -> None:
        raise AssertionError("WholeModel has no previous stage")

    def wait_sends(self) -> None:
        pass


class PipelineStage:
    """Stage ``mesh.stage`` of ``mesh.pp``: receives from the previous stage, sends to the next.

    Raises ValueError/TypeError naming the mismatch when the module is not a stage model of this
    mesh's stage, or its gradients are not summed over the stage's HDP group."""

    def __init__(self, model: Any, mesh: Any) -> None:
        module = getattr(model, "module", model)
        if not takes_layout(module) or not hasattr(module, "stages"):
            raise TypeError(f"StepExecutor: with pipelines (pp={mesh.pp}) the stage must implement the stage model "
                            f"protocol (bytescale.runtime.stage_io; bytescale's Llama.pipeline_stage), got "
                            f"{type(module).__name__}")
        self.mesh = mesh
        self.stage, self.stages = int(mesh.stage), int(mesh.pp)
        if (module.stage, module.stages) != (self.stage, self.stages):
            raise ValueError(f"StepExecutor: rank {mesh.rank} is stage {self.stage} of {self.stages}, but its "
                             f"model is stage {module.stage} of {module.stages}; call "
                             f"model.pipeline_stage(mesh.stage, mesh.pp)")
        if getattr(model, "process_group", None) is None and not getattr(model, "fsdp", False):
            raise ValueError("StepExecutor: with pipelines, sum the stage's gradients over its HDP group: "
                             "HybridDataParallel(stage, process_group=mesh.group('hdp')), or shard the stage "
                             "with FSDP2 over mesh['hdp']")
        p = next(module.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.hidden_size = int(module.hidden_size)
        # sequence parallelism: a stage's hidden states are this TP rank's rows of the sequence
        self.sp = (mesh.coords()["tp"], mesh.tp) if getattr(module, "sequence_parallel", False) else None
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self._sends: List[Any] = []
        self.waited = 0.0

    def _peer(self, stage: int) -> int:
        c = self.mesh.coords()
        return self.mesh.grid[stage][c["hdp"]][c["tp"]]

    def _send(self, t: torch.Tensor, channel: Tuple[str, int], stage: int) -> None:
        if hasattr(t, "to_local"):  # a sequence-parallel stage's output: this TP rank's rows
            t = t.to_local()
        if t.numel() == 0:  # a padding entry: both ends know from the plan that nothing crosses
            return
        t = t.detach().to(self.dtype).contiguous()
        self._sends.append(dist.isend(t, dst=self._peer(stage), group=self.mesh.p2p_group(*channel)))

    def _recv(self, shape, channel: Tuple[str, int], stage: int, where: str, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        if buf.numel() == 0:  # a padding entry (zero tokens): nothing was sent
            return buf
        peer = self._peer(stage)
        t0 = time.perf_counter()
        try:
            dist.recv(buf, src=peer, group=self.mesh.p2p_group(*channel))
        except Exception as e:  # noqa: BLE001 - re-raised with the schedule's position
            raise RuntimeError(f"StepExecutor: stage {self.stage} (rank {self.mesh.rank}) {where}: receiving the "
                               f"{what} ({shape[0]} tokens) from stage {stage} (rank {peer}) failed: {e}") from e
        self.waited += time.perf_counter() - t0
        return buf

    def receive_forward(self, shape: Tuple[int, ...], where: str) -> Optional[torch.Tensor]:
        """The previous stage's output for this micro-batch (a leaf needing grad); None on the first."""
        if self.first:
            return None
        rows = shape[0]
        if self.sp is not None:
            from ..models.llama import sequence_shard_rows

            rows = sequence_shard_rows(rows, self.sp[1], self.sp[0])
        return self._recv((rows, self.hidden_size), ("fwd", self.stage - 1), self.stage - 1, where,
                          "activations").requires_grad_(True)

    def send_forward(self, out: torch.Tensor) -> None:
        self._send(out, ("fwd", self.stage), self.stage + 1)

    def receive_backward(self, shape: Tuple[int, ...], where: str) -> torch.Tensor:
        return self._recv(shape, ("bwd", self.stage), self.stage + 1, where, "gradients")

    def send_backward(self, grad: torch.Tensor) -> None:
        self._send(grad, ("bwd", self.stage - 1), self.stage - 1)

    def wait_sends(self) -> None:
        t0 = time.perf_counter()
        try:
            for w in self._sends:
                w.wait()
        finally:
            self._sends = []
        self.waited += time.perf_counter() - t0


def stage_io(model: Any, mesh: Any):
    """The stage I/O for ``model`` on ``mesh``: :class:`PipelineStage` when ``mesh.pp`` > 1."""
    if mesh is not None and int(getattr(mesh, "pp", 1) or 1) > 1:
        return PipelineStage(model, mesh)
    return WholeModel()
