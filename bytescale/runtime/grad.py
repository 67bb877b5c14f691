"""The global gradient norm and clipping for parameters of any layout.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when parameters mix
plain tensors and DTensors, or DTensors on different meshes (an HF model under its transformers TP
plan keeps its norms plain; FSDP2 puts TP parameters on the 2-D mesh and the others on the HDP
dimension). Here each gradient's local sum of squares is summed over the mesh dimensions it is
sharded (or partial) on and counted once over those it is replicated on, one collective per
distinct (mesh, placements); plain gradients are replicated and count as they are. Gradients of
parameters that differ across a group (expert-parallel experts: ``sum_over`` maps each to its EP
group) are summed over that group.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

__all__ = ["grad_norm", "clip_grad_norm_"]


def grad_norm(parameters: Iterable[torch.Tensor], sum_over: Optional[Mapping[torch.Tensor, object]] = None) -> torch.Tensor:
    """The L2 norm of all gradients (float64 scalar on the first gradient's device; 0 with none).

    ``sum_over``: parameters whose gradients are disjoint parts of the model across a process group
    (expert parallelism: :func:`bytescale.models.expert_parallel.expert_norm_groups`; pipeline
    stages) -> that group, or a tuple of groups summed over in turn (an expert of one stage: its EP
    group, then the pipeline's). Collective over those groups: every member passes the same
    structure."""
    import torch.distributed as dist

    sum_over = sum_over or {}
    params = list(parameters)
    split: Dict[int, list] = {}
    for p in params:
        if p in sum_over and p.grad is not None:
            groups = sum_over[p] if isinstance(sum_over[p], tuple) else (sum_over[p],)
            split.setdefault(tuple(id(g) for g in groups), [groups, []])[1].append(p)
    total = _norm_sq([p for p in params if p not in sum_over])
    for groups, ps in split.values():
        sq = _norm_sq(ps)
        sq = torch.zeros((), dtype=torch.float64) if sq is None else sq.clone()
        for group in groups:
            dist.all_reduce(sq, group=group)
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        return torch.zeros((), dtype=torch.float64)
    return total.sqrt()


def _norm_sq(parameters: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    plain = None
    groups: Dict[Tuple[int, Tuple[str, ...]], list] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            sq = g.to_local().detach().double().pow(2).sum()
            kinds = tuple("replicate" if pl.is_replicate() else "sum" for pl in g.placements)
            key = (id(g.device_mesh), kinds)
            if key in groups:
                groups[key][1] = groups[key][1] + sq
            else:
                groups[key] = [g.device_mesh, sq]
        else:
            sq = g.detach().double().pow(2).sum()
            plain = sq if plain is None else plain + sq
    total = plain
    for (_, kinds), (mesh, sq) in groups.items():
        placements = [Replicate() if k == "replicate" else Partial() for k in kinds]
        full = DTensor.from_local(sq, mesh, placements, run_check=False).full_tensor()
        total = full if total is None else total + full.to(total.device)
    return total


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    sum_over: Optional[Mapping[torch.Tensor, object]] = None) -> float:
    """Scale the gradients so their global norm is at most ``max_norm``; returns the norm before
    clipping (a float, the same on every rank). ``max_norm = inf`` only measures. ``sum_over``: as
    in :func:`grad_norm`."""
    params = [p for p in parameters if p.grad is not None]
    norm = float(grad_norm(params, sum_over))
    if math.isfinite(max_norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        with torch.no_grad():
            for p in params:
                p.grad.mul_(scale)
    return norm
