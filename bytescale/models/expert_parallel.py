"""Expert parallelism for the package's MoE Llama (and an HF Mixtral, :mod:`bytescale.models.hf_moe`) under HDP.

:func:`expert_parallel` shards every MoE layer's experts over the mesh's expert-parallel group
(``bytescale.init_mesh(ep=E)``: E consecutive HDP units of one TP index): rank ``j`` of the group
keeps experts ``[j * n / E, (j + 1) * n / E)`` and drops the rest, so expert memory per rank falls
by E. Tokens travel to their experts and back by all-to-all (dropless: no capacity factor; see
:mod:`bytescale.models.moe`). Parameter names stay those of the full model (``layers.L.moe.experts.
e.w1.weight`` with ``e`` the global index), so a checkpoint written at one EP degree loads at
another (DCP reads each rank's experts by name).

Each MoE layer records its expert-data-parallel group (``moe.edp_group``;
:func:`expert_param_groups` lists the parameters): :class:`bytescale.HybridDataParallel` sums the
kept experts' gradients over that group (the ranks holding the same experts) instead of the HDP pool; dense parameters (the
router included) keep the HDP pool, or FSDP2 over the HDP dimension (EP x FSDP2). With the token-level loss the result equals single-process
training on the global batch.

The all-to-alls need every rank of an EP group to run the same number of micro-batches in an
order all agree on: the step executor's lockstep schedule per EP group (:mod:`bytescale.runtime.schedule`,
chosen from the model's ``ep_size``); a rank with fewer real micro-batches runs zero-token slots that
still join the all-to-alls, forward, backward and recomputation.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.distributed as dist
import torch.nn as nn

__all__ = ["expert_parallel", "expert_param_groups", "expert_norm_groups", "check_expert_parallel"]


def expert_param_groups(module: nn.Module) -> Dict[nn.Parameter, dist.ProcessGroup]:
    """Every expert-parallel parameter of ``module`` -> the group its gradient is summed over
    (empty without expert parallelism). Read at wrap time, after tensor parallelism replaced the
    parameters by DTensors."""
    from .moe import MoE

    out: Dict[nn.Parameter, dist.ProcessGroup] = {}
    for m in module.modules():
        if isinstance(m, MoE) and m.edp_group is not None:
            for p in m.experts.parameters():
                out[p] = m.edp_group
    return out


def expert_norm_groups(module: nn.Module) -> Dict[nn.Parameter, dist.ProcessGroup]:
    """Every expert-parallel parameter -> its EP group, over which the kept experts are disjoint
    parts of the model (the gradient norm sums them there: :func:`bytescale.runtime.grad.grad_norm`)."""
    from .moe import MoE

    out: Dict[nn.Parameter, dist.ProcessGroup] = {}
    for m in module.modules():
        if isinstance(m, MoE) and m.ep_group is not None:
            for p in m.experts.parameters():
                out[p] = m.ep_group
    return out


def check_expert_parallel(n_experts: int, ep: int, what: str = "the model") -> None:
    """Raise ValueError naming the values when ``ep`` cannot shard ``n_experts`` experts."""
    if ep < 1:
        raise ValueError(f"expert parallelism: EP degree must be >= 1, got {ep}")
    if ep > 1 and n_experts == 0:
        raise ValueError(f"expert parallelism: EP degree {ep} needs a mixture-of-experts model; {what} is dense")
    if n_experts % ep:
        raise ValueError(f"expert parallelism: EP degree {ep} does not divide the {n_experts} experts of {what}")


def expert_parallel(model: nn.Module, mesh=None, ep_group: Optional[dist.ProcessGroup] = None,
                    edp_group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """Shard the experts of the package's MoE Llama over the expert-parallel group (module
    docstring) in place; returns the model. An HF Mixtral first becomes
    :func:`bytescale.models.hf_moe.hf_moe_model` (a new module: use the returned one), whose MoE
    blocks are the package's (HF's routing, the same dispatch, an HDP-correct balance loss). Apply before :func:`tensor_parallel` and FSDP2's
    ``fully_shard``, which must leave the experts out (``ignored_params=set(expert_param_groups(model))``:
    FSDP2 shards the dense parameters, :class:`bytescale.HybridDataParallel` sums the experts).

    ``mesh``: the job's :class:`bytescale.Mesh` (default: the current one), or give ``ep_group``
    and ``edp_group`` directly. Raises ValueError when the EP degree does not divide the experts.
    """
    from .hf_moe import is_hf_moe
    from .llama import Llama
    from .moe import MoE

    hf_whole = is_hf_moe(model) and not any(isinstance(m, MoE) for m in model.modules())
    if hf_whole:  # an HF Mixtral, not yet on the package's MoE blocks
        n_experts, what = int(model.config.num_local_experts), type(model).__name__
    elif isinstance(model, Llama):
        n_experts, what = model.cfg.n_experts, "this Llama"
    else:
        blocks = [m for m in model.modules() if isinstance(m, MoE)]
        if not blocks:
            raise TypeError(f"expert_parallel: expected bytescale.models.Llama, an HF Mixtral or a model with "
                            f"bytescale MoE blocks (bytescale.models.hf_moe_model), got {type(model).__name__}")
        n_experts, what = blocks[0].n_experts, type(model).__name__
    if ep_group is None:
        if mesh is None:
            from ..comm.mesh import current_mesh

            mesh = current_mesh()
        if mesh is None:
            raise ValueError("expert_parallel: no mesh; call bytescale.init_mesh(ep=E) first or pass ep_group")
        ep_group, edp_group = mesh.group("ep"), mesh.group("edp")
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    check_expert_parallel(n_experts, ep, what)
    if hf_whole:  # checked first: a refusal leaves the caller's model whole
        from .hf_moe import hf_moe_model

        model = hf_moe_model(model)  # a new module
    if ep == 1:
        return model
    if edp_group is None:
        raise ValueError("expert_parallel: an EP group needs its expert-data-parallel group (edp_group)")
    j = dist.get_rank(ep_group)
    for m in model.modules():
        if not isinstance(m, MoE):
            continue
        if not isinstance(m.experts, nn.ModuleList):
            raise ValueError("expert_parallel: the model's experts are already sharded")
        per = m.n_experts // ep
        keep = nn.ModuleDict({str(e): m.experts[e] for e in range(j * per, (j + 1) * per)})
        m.experts = keep
        m.ep_group, m.ep_size, m.edp_group = ep_group, ep, edp_group
    model.ep_size = ep
    return model
