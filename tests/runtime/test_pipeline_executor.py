"""Pipeline parallelism under HDP (issue 23): each stage runs its pipeline's micro-batches in the
1F1B order of the plan's slots (bytescale.runtime.StepExecutor), activations and gradients
cross the stage boundaries on their channels, rings run at every stage on their member pipelines
at a common slot. After several optimizer steps every stage's parameters, and every step's loss,
equal single-process training of the whole model on the same global batches (float64, tight
tolerance): PP 2 x HDP 2 (PP-Balance: uneven micro-batch counts across pipelines, rings, mixed
local and sharded documents; and with MoE layers), PP 2 x HDP 2 x TP 2 (8 processes), PP 3 x HDP 1 (three stages,
warm-up of two), and batches so small that a pipeline has nothing to run; then a matrix of meshes
(PP 2 x HDP 2, PP 2 x HDP 3, PP 4, PP 2 x TP 2) x plan strategies (pp-balance, pp-lockstep,
balanced, naive, pow2) x batches, each ending equal to single-process training. Bad input: a plan for
another depth, a layer count the stages do not divide; a stage that dies mid-step makes every
survivor raise within the timeout; and one channel for both directions (what the per-direction
channels avoid) surfaces under NCCL's execution model as the transport's timeout error naming the
stuck transfer, not as a hang. scripts/run_tests.sh runs this file again under
``BYTESCALE_NCCL_ORDER=1`` (one in-order queue per group, as one NCCL stream per communicator).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig
from bytescale.data import HDPLoader, SyntheticTokens
from bytescale.models import Llama, LlamaConfig
from fixtures import TINY, tiny_llama
from dist_utils import capture_error, run_distributed, train_on_whole_documents

pytestmark = pytest.mark.multiprocess

CFG = TINY
# a 300-token document needs a ring of 2 units at capacity 160
LENGTHS = [300, 97, 13, 7, 45, 3, 130, 31, 64, 9, 150, 22, 5, 77, 1, 40, 211]
SMALL = [23, 5, 17, 2, 40, 11]  # 20-token batches: one or two documents, a pipeline without any


@dataclasses.dataclass(frozen=True)
class Case:
    pp: int
    hdp: int
    tp: int = 1
    strategy: str = "pp-balance"
    lengths: tuple = tuple(LENGTHS)
    tokens_per_batch: int = 700
    capacity: int = 160
    seed: int = 6  # with pp-balance: uneven counts, rings (one in a last slot), local and sharded mixed
    steps: int = 3
    n_layers: int = 2
    moe: bool = False
    fsdp: bool = False  # FSDP2 over each stage's HDP group (padded 1F1B slots)
    ep: int = 1         # experts sharded over blocks of ep pipelines per stage (padded 1F1B slots)
    sp: bool = False    # sequence parallelism inside TP: each TP rank sends its rows of the sequence
    act_ckpt: bool = False  # activation checkpointing (recompute inside each backward, at every stage)
    offload: bool = False   # the plan's offload ratios (activations to host memory in each stage's forward)


def _dataset(case: Case):
    return SyntheticTokens(list(case.lengths), vocab_size=CFG.vocab_size, seed=11)


def _cfg(case: Case) -> LlamaConfig:
    cfg = dataclasses.replace(CFG, n_layers=case.n_layers)
    return dataclasses.replace(cfg, n_experts=4, top_k=2, ffn_dim=24) if case.moe else cfg


def _model(cfg: LlamaConfig) -> Llama:
    return tiny_llama(cfg)


def _loader_config(case: Case, **kw) -> LoaderConfig:
    return LoaderConfig(case.tokens_per_batch, seed=case.seed, max_steps=case.steps, **kw)


def _reference(case: Case):
    """One process, the whole model, whole documents, the same global batches."""
    ds = _dataset(case)
    loader = HDPLoader(ds, PlannerConfig(case.capacity), _loader_config(case, check_plan=False, prefetch=False),
                       rank=0, world_size=case.hdp)
    model = _model(_cfg(case))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, batches = train_on_whole_documents(ds, loader, model, opt)
    return {n: p.detach() for n, p in model.named_parameters()}, losses, batches


def _stage_setup(case: Case):
    import bytescale
    from bytescale import HybridDataParallel, StepExecutor
    from bytescale.models.parallel import tensor_parallel

    mesh = bytescale.init_mesh(tp=case.tp, pp=case.pp, ep=case.ep)
    net = _model(_cfg(case))
    if case.ep > 1:
        from bytescale.models import expert_parallel

        expert_parallel(net, mesh)
    net.pipeline_stage(mesh.stage, mesh.pp)
    net.activation_checkpointing = case.act_ckpt
    if case.tp > 1:
        tensor_parallel(net, mesh["tp"], sequence_parallel=case.sp)
    if case.fsdp:
        from torch.distributed.fsdp import fully_shard

        from bytescale.models.expert_parallel import expert_param_groups

        experts = set(expert_param_groups(net))  # EP x FSDP2: experts stay EP-sharded, out of FSDP2
        for layer in net.layers.values():
            fully_shard(layer, mesh=mesh["hdp"], ignored_params=experts)
        fully_shard(net, mesh=mesh["hdp"], ignored_params=experts)
        model = HybridDataParallel(net, config=RuntimeConfig(bucket_cap_mb=0.01))
    else:
        model = HybridDataParallel(net, process_group=mesh.group("hdp"), config=RuntimeConfig(bucket_cap_mb=0.01))
    # the depth comes from the mesh (a loader on a mesh plans for its dims)
    loader = HDPLoader(_dataset(case), PlannerConfig(case.capacity, case.strategy, offload=case.offload),
                       _loader_config(case), units=mesh)
    return mesh, net, model, loader, StepExecutor(model, mesh=mesh)


def _pp_worker(rank, world, case):
    from bytescale.runtime import build_schedule

    mesh, net, model, loader, executor = _stage_setup(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = []
    for step in loader:
        sched = build_schedule(step.plan, rank, executor.kind)
        out = executor.run(step)
        opt.step()
        opt.zero_grad()
        slots = step.plan.micro_batch_slots(rank)
        stats.append({"ids": list(step.sample_ids), "loss": out.loss, "slots": slots,
                      "rings": [tuple(m.plan.ring) for m in step.micro_batches],
                      "sharded": [m.plan.is_ring for m in step.micro_batches],
                      "docs": [[d.batch_pos for d in m.plan.documents] for m in step.micro_batches],
                      "entries": len(sched), "padding": sched.padding, "kind": executor.kind.describe(),
                      "offload": max([m.plan.offload_ratio for m in step.micro_batches], default=0.0)})
    loader.close()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in net.named_parameters()}
    return params, stats, mesh.coords()


def _check(case: Case, timeout: float = 420):
    ref, ref_losses, batches = _reference(case)
    per_rank = run_distributed(_pp_worker, case.pp * case.hdp * case.tp, case, timeout=timeout)
    seen = {n: 0 for n in ref}
    for params, stats, c in per_rank:
        assert [s["ids"] for s in stats] == batches
        for n, p in params.items():
            torch.testing.assert_close(p, ref[n], rtol=1e-9, atol=1e-11, msg=lambda m: f"{n} (rank {c}): {m}")
            seen[n] += 1
    assert all(seen.values()), f"parameters no stage holds: {[n for n, v in seen.items() if not v]}"
    # the step's loss: the last stage's, summed over its units (TP index 0), equals the reference
    for k in range(case.steps):
        total = sum(st[k]["loss"] for _, st, c in per_rank if c["tp"] == 0 and c["pp"] == case.pp - 1)
        assert total == pytest.approx(ref_losses[k], rel=1e-10)
        assert all(st[k]["loss"] == 0.0 for _, st, c in per_rank if c["pp"] != case.pp - 1)
    # every stage of a pipeline ran the same micro-batches at the same slots
    by_pipe = {}
    for _, st, c in per_rank:
        by_pipe.setdefault((c["hdp"], c["tp"]), []).append([(s["slots"], s["docs"]) for s in st])
    for key, runs in by_pipe.items():
        assert all(r == runs[0] for r in runs), f"pipeline {key}: stages ran different micro-batches"
    return [(st, c) for _, st, c in per_rank]


def test_pp2_hdp2_pp_balance_matches_single_process():
    runs = _check(Case(pp=2, hdp=2))
    stage0 = [st for st, c in runs if c["pp"] == 0]
    counts = [[len(s["slots"]) for s in st] for st in stage0]
    assert any(a != b for a, b in zip(*counts)), f"no step with uneven micro-batch counts: {counts}"
    assert any(any(s["sharded"]) for st in stage0 for s in st), "no ring ran"
    assert any(any(not x for x in s["sharded"]) and any(s["sharded"]) for st in stage0 for s in st), \
        "no step mixed local and sharded documents"
    # a ring in a pipeline's last slot
    assert any(s["sharded"] and s["sharded"][-1] for st in stage0 for s in st)


def test_pp2_hdp2_lockstep_with_an_empty_pipeline_matches_single_process():
    runs = _check(Case(pp=2, hdp=2, strategy="pp-lockstep", lengths=tuple(SMALL), tokens_per_batch=20,
                       capacity=64, steps=4))
    assert any(len(s["slots"]) == 0 for st, c in runs for s in st), "no pipeline was empty in any step"


def test_pp2_hdp2_moe_balance_loss_of_every_stage_matches_single_process():
    # each stage's MoE layers add their router balance loss to its own backward
    _check(Case(pp=2, hdp=2, moe=True, steps=2))


def _padded(runs, case: Case, what: str) -> None:
    """Every member of a block ran the same number of entries; some ran padding."""
    block = case.hdp if case.fsdp or case.ep == 1 else case.ep
    for st, c in runs:
        assert all(what in s["kind"] for s in st), st[0]["kind"]
    for k in range(case.steps):
        for b in range(0, case.hdp, block):
            for p in range(case.pp):
                assert len({st[k]["entries"] for st, c in runs if b <= c["hdp"] < b + block and c["pp"] == p}) == 1
    assert any(s["padding"] for st, _ in runs for s in st), "no pipeline ran a padding slot"


def test_pp2_hdp2_with_fsdp2_matches_single_process():
    # FSDP2 over each stage's HDP group: uneven PP-Balance counts padded to the stage's slots
    case = Case(pp=2, hdp=2, fsdp=True)
    _padded(_check(case), case, "slots padded over all HDP units")


def test_pp2_hdp2_with_expert_parallelism_matches_single_process():
    # each stage's MoE layers sharded over its EP group (the stage's two pipelines)
    case = Case(pp=2, hdp=2, moe=True, ep=2, steps=2)
    _padded(_check(case), case, "slots padded over blocks of 2 HDP units")


def test_the_whole_pp2_tp2_ep2_fsdp2_at_world_8_matches_single_process():
    # units of TP 2, HDP 2 per stage; each stage's experts over its EP group (both pipelines), the
    # dense parameters FSDP2-sharded over the stage's HDP group: the world's slots padded per stage
    case = Case(pp=2, hdp=2, tp=2, moe=True, ep=2, fsdp=True, steps=2)
    runs = _check(case, timeout=600)
    _padded(runs, case, "slots padded over all HDP units")


def test_pp2_hdp2_with_activation_checkpointing_and_the_plans_offload_ratios_matches_single_process():
    runs = _check(Case(pp=2, hdp=2, act_ckpt=True, offload=True, steps=2))
    assert any(s["offload"] > 0 for st, _ in runs for s in st), "the plan offloaded nothing"


def test_pp2_tp2_with_sequence_parallelism_matches_single_process():
    # the stage boundary carries each TP rank's rows of the sequence (uneven: T not divisible by 2)
    _check(Case(pp=2, hdp=1, tp=2, sp=True, strategy="balanced", capacity=600, steps=2))


def test_pp3_hdp1_three_stages_match_single_process():
    _check(Case(pp=3, hdp=1, n_layers=3, strategy="balanced", capacity=600))


def test_pp2_hdp2_tp2_matches_single_process():
    runs = _check(Case(pp=2, hdp=2, tp=2), timeout=600)
    for st, c in runs:
        for s in st:
            for ring in s["rings"]:
                assert all(r % 2 == c["tp"] for r in ring), (ring, c)


# -- bad input and faults ---------------------------------------------------------------------------

def _wrong_depth_worker(rank, world):
    import bytescale
    from bytescale import HybridDataParallel, StepExecutor

    mesh = bytescale.init_mesh(pp=2)
    net = _model(CFG).pipeline_stage(mesh.stage, mesh.pp)
    model = HybridDataParallel(net, process_group=mesh.group("hdp"))
    case = Case(pp=2, hdp=1)
    # a loader on the mesh takes the depth from it: a planner config saying otherwise is refused
    refused = capture_error(lambda: HDPLoader(_dataset(case), PlannerConfig(600, "balanced", pp=3),
                                              _loader_config(case), units=mesh))
    # a plan made for depth 3 over the bare unit map reaches the executor, which refuses it
    loader = HDPLoader(_dataset(case), PlannerConfig(600, "balanced", pp=3), _loader_config(case), units=mesh.units)
    step = next(iter(loader))
    loader.close()
    return refused, capture_error(lambda: StepExecutor(model, mesh=mesh).run(step))


def test_a_plan_for_another_depth_raises_on_every_stage():
    for (kind, msg, _), (kind2, msg2, _) in run_distributed(_wrong_depth_worker, 2, timeout=180):
        assert kind == "ValueError" and "PlannerConfig(pp=3) contradicts the mesh's pp=2" in msg, msg
        assert kind2 == "ValueError" and "3" in msg2 and "2" in msg2 and "1F1B" in msg2, msg2


def test_a_layer_count_the_stages_do_not_divide_raises():
    with pytest.raises(ValueError, match="3 stages do not divide the model's 2 layers"):
        _model(CFG).pipeline_stage(0, 3)
    with pytest.raises(ValueError, match=r"stage 2 outside \[0, 2\)"):
        _model(CFG).pipeline_stage(2, 2)


def _dying_stage_worker(rank, world):
    case = Case(pp=2, hdp=2, steps=2)
    mesh, net, model, loader, executor = _stage_setup(case)
    steps = iter(loader)
    executor.run(next(steps))
    step = next(steps)
    if rank == world - 1:  # the last stage of pipeline 1 dies before its second step
        os._exit(0)
    return capture_error(lambda: executor.run(step))


def test_a_stage_that_dies_mid_step_makes_every_survivor_raise():
    results = run_distributed(_dying_stage_worker, 4, timeout=240, pg_timeout=8.0)
    assert results[3] is None
    for kind, msg, took in results[:3]:
        assert kind is not None, "a survivor finished the step although a stage died"
        assert took < 120, (msg, took)


def _shared_channel_worker(rank, world):
    case = Case(pp=2, hdp=1, strategy="balanced", capacity=600, steps=1)
    mesh, net, model, loader, executor = _stage_setup(case)
    # both directions on one group: the stream order of NCCL (a send waits for its receive, one
    # in-order queue per communicator) deadlocks 1F1B, which must surface as an error, not a hang
    mesh.pipeline_groups[("bwd", 0)] = mesh.pipeline_groups[("fwd", 0)]
    step = next(iter(loader))
    loader.close()
    return capture_error(lambda: executor.run(step))


def test_one_shared_channel_would_deadlock_under_nccl_order(monkeypatch):
    """Why the channels are per direction: with NCCL's execution model (BYTESCALE_NCCL_ORDER=1 on
    CPU) one group for both directions deadlocks (stage 0 sends the forward of slot 1 while stage
    1 sends the backward of slot 0); the transport's timeout names it, on both stages."""
    monkeypatch.setenv("BYTESCALE_NCCL_ORDER", "1")
    results = run_distributed(_shared_channel_worker, 2, timeout=240, pg_timeout=6.0)
    for kind, msg, took in results:
        assert kind is not None, "one shared channel ran 1F1B to the end under NCCL order"


# -- the hang matrix: meshes x plan strategies x batches, each ending equal to single-process training

MATRIX_STRATEGIES = ("pp-balance", "pp-lockstep", "balanced", "naive", "pow2")
MATRIX_SEEDS = (6, 9)


def _matrix_capacity(hdp: int) -> int:
    return 160 if hdp > 1 else 600  # one pipeline holds the 300-token document alone


def _matrix_worker(rank, world, pp, hdp, tp, n_layers):
    mesh = None
    out = {}
    for strategy in MATRIX_STRATEGIES:
        for seed in MATRIX_SEEDS:
            case = Case(pp=pp, hdp=hdp, tp=tp, strategy=strategy, seed=seed, steps=2, n_layers=n_layers,
                        capacity=_matrix_capacity(hdp))
            if mesh is None:
                mesh, net, model, loader, executor = _stage_setup(case)
            else:  # the same mesh (its groups), a fresh model and loader
                from bytescale import HybridDataParallel, StepExecutor
                from bytescale.models.parallel import tensor_parallel

                net = _model(_cfg(case)).pipeline_stage(mesh.stage, mesh.pp)
                if tp > 1:
                    tensor_parallel(net, mesh["tp"])
                model = HybridDataParallel(net, process_group=mesh.group("hdp"),
                                           config=RuntimeConfig(bucket_cap_mb=0.01))
                loader = HDPLoader(_dataset(case), PlannerConfig(case.capacity, strategy, pp=pp),
                                   _loader_config(case), units=mesh)
                executor = StepExecutor(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            losses, shapes = [], []
            for step in loader:
                losses.append(executor.run(step).loss)
                opt.step()
                opt.zero_grad()
                shapes.append((len(step.micro_batches), sum(m.plan.is_ring for m in step.micro_batches)))
            loader.close()
            out[(strategy, seed)] = ({n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                                      for n, p in net.named_parameters()}, losses, shapes)
    return out, mesh.coords()


@pytest.mark.parametrize("pp,hdp,tp,n_layers", [(2, 2, 1, 2), (2, 3, 1, 2), (4, 1, 1, 4), (2, 1, 2, 2)],
                         ids=["pp2xhdp2", "pp2xhdp3", "pp4", "pp2xtp2"])
def test_matrix_of_meshes_strategies_and_batches_matches_single_process(pp, hdp, tp, n_layers):
    refs = {seed: _reference(Case(pp=pp, hdp=hdp, tp=tp, seed=seed, steps=2, n_layers=n_layers,
                                  capacity=_matrix_capacity(hdp)))
            for seed in MATRIX_SEEDS}
    per_rank = run_distributed(_matrix_worker, pp * hdp * tp, pp, hdp, tp, n_layers, timeout=600)
    uneven = rings = False
    for out, c in per_rank:
        for (strategy, seed), (params, losses, shapes) in out.items():
            ref, ref_losses, _ = refs[seed]
            for n, p in params.items():
                torch.testing.assert_close(p, ref[n], rtol=1e-9, atol=1e-11,
                                           msg=lambda m: f"{strategy} seed {seed} {n} (rank {c}): {m}")
            rings |= any(r for _, r in shapes)
    for k in range(2):  # the step's loss summed over the last stage's units, per configuration
        for key in out:
            total = sum(o[key][1][k] for o, c in per_rank if c["pp"] == pp - 1 and c["tp"] == 0)
            assert total == pytest.approx(refs[key[1]][1][k], rel=1e-10), key
    if hdp > 1:
        counts = {}
        for out, c in per_rank:
            if c["pp"] == 0 and c["tp"] == 0:
                for key, (_, _, shapes) in out.items():
                    counts.setdefault(key, []).append(tuple(n for n, _ in shapes))
        uneven = any(len(set(v)) > 1 for v in counts.values())
        assert uneven and rings, (counts, rings)
