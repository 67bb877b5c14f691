"""Expert parallelism for the MoE Llama under HDP (``bytescale.init_mesh(ep=E)``).

Each MoE layer's experts are sharded over E consecutive HDP ranks; tokens go to their experts and
back by uneven all-to-alls (dropless). The step executor runs the plan's lockstep slots per EP group, so
ranks with fewer real micro-batches (none at all, in some steps) run zero-token slots that still
join the all-to-alls, forward, backward and, with activation checkpointing, recomputation. After
several SGD steps every parameter (experts by their global name) and every step's loss equal
single-process float64 training on the same global batches; documents are sharded over rings of
2 and 3 ranks that cross EP groups. A step whose micro-batches are not the plan's (on one rank) is
refused on every rank with a clear error instead of hanging in an all-to-all.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig
from bytescale.data import HDPLoader, SyntheticTokens
from bytescale.models import Llama, LlamaConfig
from dist_utils import capture_error, run_distributed, train_on_whole_documents

pytestmark = pytest.mark.multiprocess

MOE = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, n_experts=4, top_k=2)
# at capacity 100 over 4 ranks: 250 and 210 tokens need rings of 3, 150 and 130 rings of 2; small
# batches leave ranks without a micro-batch, big ones give some ranks several
LENGTHS = [250, 9, 13, 7, 45, 3, 130, 31, 64, 150, 22, 5, 77, 1, 40, 210, 2, 17]
TOKENS_PER_BATCH = 300
CAPACITY = 100
STEPS = 4
WORLD = 4


def _dataset():
    return SyntheticTokens(LENGTHS, vocab_size=MOE.vocab_size, seed=3)


def _model(cfg: LlamaConfig) -> Llama:
    torch.manual_seed(0)
    return Llama(cfg).to(torch.float64)


def _loader_config(**kw) -> LoaderConfig:
    return LoaderConfig(TOKENS_PER_BATCH, seed=15, max_steps=STEPS, **kw)


def _reference(cfg: LlamaConfig, world: int = WORLD, capacity: int = CAPACITY):
    """One process, whole documents, the same global batches: parameters by name, losses."""
    ds = _dataset()
    loader = HDPLoader(ds, PlannerConfig(capacity), _loader_config(check_plan=False, prefetch=False),
                       rank=0, world_size=world)
    model = _model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, batches = train_on_whole_documents(ds, loader, model, opt)
    loader.close()
    return {k: v.detach() for k, v in model.named_parameters()}, losses, batches


def _ep_worker(rank, world, cfg_dict, ep, act_ckpt, tamper=False, tp=1, capacity=CAPACITY):
    import bytescale
    from bytescale import HybridDataParallel
    from bytescale.models import expert_parallel
    from bytescale.runtime import StepExecutor, build_schedule
    from bytescale.runtime.grad import grad_norm
    from bytescale.models.expert_parallel import expert_norm_groups

    cfg = LlamaConfig(**cfg_dict)
    mesh = bytescale.init_mesh(ep=ep, tp=tp)
    net = expert_parallel(_model(cfg), mesh)
    if tp > 1:
        from bytescale.models.parallel import tensor_parallel

        tensor_parallel(net, mesh["tp"])
    net.activation_checkpointing = act_ckpt
    model = HybridDataParallel(net, process_group=mesh.group("hdp") if tp > 1 else None,
                               config=RuntimeConfig(bucket_cap_mb=0.01))
    loader = HDPLoader(_dataset(), PlannerConfig(capacity),
                       _loader_config())
    executor = StepExecutor(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = []
    try:
        for step in loader:
            if tamper and step.plan.num_micro_batches(step.plan.units.unit_of(rank)) and \
                    rank == min(r for r in range(world) if step.plan.num_micro_batches(step.plan.units.unit_of(r))):
                step = dataclasses.replace(step, micro_batches=step.micro_batches[1:])  # not the plan's
            out = executor.run(step)
            norm = float(grad_norm(model.parameters(), expert_norm_groups(net)))
            opt.step()
            opt.zero_grad()
            mbs = build_schedule(step.plan, rank, executor.kind).entries  # what the executor ran
            stats.append({"ids": list(step.sample_ids), "loss": out.loss, "slots": len(mbs),
                          "real": sum(1 for m in mbs if not m.is_empty),
                          "rings": [len(m.ring) for m in mbs], "norm": norm})
    except ValueError as e:
        return {"error": str(e)}
    finally:
        loader.close()
    experts = sorted({int(n.split(".")[4]) for n, _ in net.named_parameters() if ".experts." in n})
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in net.named_parameters()}
    return {"params": full, "stats": stats, "coords": mesh.coords(),
            "ep_ranks": mesh.ranks("ep"), "edp_ranks": mesh.ranks("edp"), "experts": experts}


def _check(ep: int, act_ckpt: bool = False, tp: int = 1):
    ref, ref_losses, batches = _reference(MOE)
    res = run_distributed(_ep_worker, WORLD, dataclasses.asdict(MOE), ep, act_ckpt, False, tp,
                          CAPACITY if tp == 1 else 160, timeout=480)
    per = MOE.n_experts // ep
    units = WORLD // tp
    for rank, r in enumerate(res):
        h, t = r["coords"]["hdp"], r["coords"]["tp"]
        assert r["ep_ranks"] == tuple(u * tp + t for u in range(h // ep * ep, h // ep * ep + ep))
        assert r["experts"] == list(range((h % ep) * per, (h % ep + 1) * per))
        assert [s["ids"] for s in r["stats"]] == batches
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref[name], rtol=1e-9, atol=1e-11, msg=lambda m: f"rank {rank} {name}: {m}")
        n_exp = sum(1 for n in r["params"] if ".experts." in n)
        assert n_exp == sum(1 for n in ref if ".experts." in n) // ep  # expert memory per rank / ep
    for k in range(STEPS):
        first = [r for r in res if r["coords"]["tp"] == 0]  # a unit's loss once
        assert sum(r["stats"][k]["loss"] for r in first) == pytest.approx(ref_losses[k], rel=1e-10)
        norms = {round(r["stats"][k]["norm"], 12) for r in res}
        assert len(norms) == 1, norms  # the global gradient norm, the same on every rank
        # the EP lockstep rule: every member of an EP group runs the same number of slots
        for b in range(0, units, ep):
            assert len({r["stats"][k]["slots"] for r in res if b <= r["coords"]["hdp"] < b + ep}) == 1
    if tp > 1:
        return res
    # the cases this test is about did occur
    real = [[r["stats"][k]["real"] for r in res] for k in range(STEPS)]
    assert any(0 in row for row in real), f"no step left a rank without a micro-batch: {real}"
    assert any(len(set(row) - {0}) > 1 for row in real), f"no step with uneven micro-batch counts: {real}"
    rings = {n for r in res for s in r["stats"] for n in s["rings"]}
    assert {2, 3} <= rings, rings
    return res


@pytest.mark.nccl_order
def test_ep2_over_hdp4_matches_single_process_float64():
    _check(ep=2)


@pytest.mark.nccl_order
def test_ep4_over_hdp4_with_activation_checkpointing_matches_single_process_float64():
    _check(ep=4, act_ckpt=True)


@pytest.mark.nccl_order
def test_ep2_with_tp2_matches_single_process_float64():
    # HDP 2 x TP 2: the EP group is the two units' ranks of one TP index; experts TP-sharded inside
    _check(ep=2, tp=2)


@pytest.mark.nccl_order
def test_a_step_that_is_not_the_plans_is_refused_on_every_rank_not_hung():
    res = run_distributed(_ep_worker, WORLD, dataclasses.asdict(MOE), 2, False, True, timeout=240)
    errors = [r.get("error", "") for r in res]
    assert all("StepExecutor: step 0" in e and "lockstep over blocks of 2 HDP units" in e for e in errors), errors
    # the tampered rank names its own mismatch; every other rank that another rank could not
    assert sum("another rank cannot run its schedule" not in e for e in errors) == 1, errors
    assert any("micro-batches" in e and "another rank" not in e for e in errors), errors
    assert sum("another rank cannot run its schedule" in e for e in errors) == WORLD - 1, errors


# -- EP x FSDP2: dense parameters FSDP2-sharded over the HDP dimension, experts over the EP group ------

def _ep_fsdp_worker(rank, world, cfg_dict, ep, capacity, tp):
    import bytescale
    from torch.distributed.fsdp import fully_shard

    from bytescale import HybridDataParallel
    from bytescale.models import expert_parallel
    from bytescale.models.expert_parallel import expert_norm_groups, expert_param_groups
    from bytescale.runtime import StepExecutor, build_schedule
    from bytescale.runtime.grad import grad_norm

    cfg = LlamaConfig(**cfg_dict)
    mesh = bytescale.init_mesh(ep=ep, tp=tp)
    # FSDP2 over the experts too: refused with the fix named, before any step
    bad = expert_parallel(_model(cfg), mesh)
    fully_shard(bad, mesh=mesh["hdp"])
    refused = capture_error(lambda: HybridDataParallel(bad))
    net = expert_parallel(_model(cfg), mesh)
    if tp > 1:
        from bytescale.models.parallel import tensor_parallel

        tensor_parallel(net, mesh["tp"])
    experts = set(expert_param_groups(net))
    for block in net.layers.values():
        fully_shard(block, mesh=mesh["hdp"], ignored_params=experts)
    fully_shard(net, mesh=mesh["hdp"], ignored_params=experts)
    model = HybridDataParallel(net, config=RuntimeConfig(bucket_cap_mb=0.01))
    layout = {n: type(p).__name__ for n, p in net.named_parameters()}
    loader = HDPLoader(_dataset(), PlannerConfig(capacity), _loader_config())
    # FSDP2 (all-gathers in every forward): the world's lockstep slots, which hold the all-to-alls too
    executor = StepExecutor(model, mesh=mesh)
    assert executor.kind.describe() == "lockstep over all HDP units"
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = []
    try:
        for step in loader:
            loss = executor.run(step).loss
            norm = float(grad_norm(model.parameters(), expert_norm_groups(net)))
            opt.step()
            opt.zero_grad()
            mbs = build_schedule(step.plan, rank, executor.kind).entries  # what the executor ran
            stats.append({"ids": list(step.sample_ids), "loss": loss, "slots": len(mbs), "norm": norm,
                          "real": sum(1 for m in mbs if not m.is_empty),
                          "rings": [len(m.ring) for m in mbs]})
    finally:
        loader.close()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in net.named_parameters()}
    coords = mesh.coords()
    return {"params": full, "stats": stats, "layout": layout, "refused": refused, "hdp": coords["hdp"],
            "tp": coords["tp"]}


@pytest.mark.parametrize("world, tp", [(4, 1), (2, 1), (4, 2)], ids=["hdp4", "hdp2", "hdp2-tp2"])
def test_ep2_with_fsdp2_matches_single_process_float64(world, tp):
    """EP 2 x FSDP2 over HDP 4 (expert-data-parallel groups of 2), HDP 2 (of 1) and HDP 2 x TP 2:
    the dense parameters FSDP2-sharded and reduce-scattered over the HDP dimension (TP inside),
    the experts EP-sharded (TP-sharded inside) and summed over their EDP group; every step's loss
    and every parameter equal single-process float64 training on the same global batches."""
    capacity = CAPACITY if world // tp == 4 else 160  # HDP 2: rings of 2 hold the longest document
    ref, ref_losses, batches = _reference(MOE, world // tp, capacity)
    res = run_distributed(_ep_fsdp_worker, world, dataclasses.asdict(MOE), 2, capacity, tp, timeout=300)
    per = MOE.n_experts // 2
    for rank, r in enumerate(res):
        kind, msg, _ = r["refused"]
        assert kind == "ValueError" and "ignored_params" in msg and "experts" in msg, msg
        assert [s["ids"] for s in r["stats"]] == batches
        mine = {int(n.split(".")[4]) for n in r["params"] if ".experts." in n}
        assert mine == set(range(r["hdp"] % 2 * per, (r["hdp"] % 2 + 1) * per))
        # the experts are this rank's own (plain, or TP's DTensors on the "tp" mesh), the rest FSDP2 shards
        assert all((kind == "Parameter") == (".experts." in n) for n, kind in r["layout"].items()
                   if tp == 1), r["layout"]
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref[name], rtol=1e-9, atol=1e-11, msg=lambda m: f"rank {rank} {name}: {m}")
    for k in range(STEPS):
        loss = sum(r["stats"][k]["loss"] for r in res if r["tp"] == 0)  # a unit's loss once
        assert loss == pytest.approx(ref_losses[k], rel=1e-10)
        assert len({round(r["stats"][k]["norm"], 12) for r in res}) == 1  # the global norm on every rank
        assert len({r["stats"][k]["slots"] for r in res}) == 1  # FSDP2: every rank every slot
    real = [[r["stats"][k]["real"] for r in res] for k in range(STEPS)]
    if tp > 1:
        return
    assert any(len(set(row)) > 1 for row in real), f"no step with uneven micro-batch counts: {real}"
    if world == 4:
        assert any(0 in row for row in real), f"no step left a rank without a micro-batch: {real}"
        assert {2, 3} <= {n for r in res for s in r["stats"] for n in s["rings"]}


def _bad_mesh(rank, world, ep):
    import bytescale

    return capture_error(lambda: bytescale.init_mesh(ep=ep))


def test_ep_that_does_not_divide_hdp_or_experts_is_a_clear_error():
    for kind, msg, _ in run_distributed(_bad_mesh, 3, 2, timeout=120):
        assert kind == "ValueError" and "ep=2 does not divide the 3 HDP units" in msg
    from bytescale.models.expert_parallel import check_expert_parallel

    with pytest.raises(ValueError, match="EP degree 3 does not divide the 4 experts"):
        check_expert_parallel(4, 3)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_expert_parallel(0, 2)
