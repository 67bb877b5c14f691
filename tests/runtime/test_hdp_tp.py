"""HDP over units of TP ranks: the planner plans HDP units, a ring of d units runs once per TP
index, the package's Llama runs tensor-parallel inside each unit (torch.distributed.tensor.parallel).
After several optimizer steps the parameters, and every step's loss, equal single-process training
on the same global batches (float64, tight tolerance): HDP 2 x TP 2 and HDP 3 x TP 2 with rings of
2 and 3 units on mixed local and sharded documents; dense and MoE; KV heads sharded and KV heads
replicated (TP larger than the KV heads); with and without sequence parallelism; with FSDP2 over
the HDP dimension.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig
from bytescale.data import HDPLoader, SyntheticTokens
from bytescale.models import Llama, LlamaConfig
from fixtures import TINY, tiny_llama
from dist_utils import run_distributed, train_on_whole_documents

pytestmark = pytest.mark.multiprocess

DENSE = TINY
# a 300-token document needs a ring of 3 units at capacity 110, of 2 at capacity 160
LENGTHS = [300, 97, 13, 7, 45, 3, 130, 31, 64, 9, 150, 22, 5, 77, 1, 40, 211]
TOKENS_PER_BATCH = 520
STEPS = 3
CAPACITY = {2: 160, 3: 110}


def _dataset():
    return SyntheticTokens(LENGTHS, vocab_size=DENSE.vocab_size, seed=11)


def _model(cfg: LlamaConfig) -> Llama:
    return tiny_llama(cfg)


def _loader_config(**kw) -> LoaderConfig:
    return LoaderConfig(TOKENS_PER_BATCH, seed=5, max_steps=STEPS, **kw)


def _reference(cfg: LlamaConfig, hdp: int):
    """One process, whole documents, the same global batches: parameters and per-step losses."""
    ds = _dataset()
    loader = HDPLoader(ds, PlannerConfig(CAPACITY[hdp]), _loader_config(check_plan=False, prefetch=False),
                       rank=0, world_size=hdp)
    model = _model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, batches = train_on_whole_documents(ds, loader, model, opt)
    return [p.detach() for p in model.parameters()], losses, batches


def _tp_worker(rank, world, cfg_dict, tp, sp, fsdp):
    import bytescale
    from bytescale import HybridDataParallel
    from bytescale.models.parallel import tensor_parallel

    cfg = LlamaConfig(**cfg_dict)
    mesh = bytescale.init_mesh(tp=tp)
    hdp = mesh.hdp
    net = tensor_parallel(_model(cfg), mesh["tp"], sequence_parallel=sp)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in net.layers.values():
            fully_shard(layer, mesh=mesh["hdp"])
        fully_shard(net, mesh=mesh["hdp"])
        model = HybridDataParallel(net)
    else:
        model = HybridDataParallel(net, process_group=mesh.group("hdp"),
                                   config=RuntimeConfig(bucket_cap_mb=0.01))
    loader = HDPLoader(_dataset(), PlannerConfig(CAPACITY[hdp], "pow2" if hdp == 3 else "balanced"),
                       _loader_config())
    executor = bytescale.StepExecutor(model, mesh=mesh)  # FSDP2: its lockstep schedule
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = []
    for step in loader:
        mbs = step.micro_batches
        loss_sum = executor.run(step).loss
        opt.step()
        opt.zero_grad()
        stats.append((list(step.sample_ids), [len(m.plan.ring) for m in mbs],
                      [tuple(m.plan.ring) for m in mbs], [m.plan.documents for m in mbs], loss_sum))
    loader.close()
    params = [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()]
    return params, stats, mesh.coords()


def _check(cfg: LlamaConfig, hdp: int, tp: int, sp: bool = False, fsdp: bool = False):
    ref, ref_losses, batches = _reference(cfg, hdp)
    per_rank = run_distributed(_tp_worker, hdp * tp, dataclasses.asdict(cfg), tp, sp, fsdp, timeout=420)
    rings = set()
    for params, stats, coords in per_rank:
        assert [s[0] for s in stats] == batches
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-11)
        rings |= {n for s in stats for n in s[1]}
    # every TP rank of a unit ran the unit's micro-batches (same documents, same order); its rings
    # are over the ranks of its own TP index
    by_unit = {}
    for params, stats, c in per_rank:
        by_unit.setdefault(c["hdp"], []).append((c["tp"], stats))
        for s in stats:
            for ring in s[2]:
                assert all(r % tp == c["tp"] for r in ring), (ring, c)
    for unit, members in by_unit.items():
        docs = [[s[3] for s in st] for _, st in members]
        assert all(d == docs[0] for d in docs), f"unit {unit}: TP ranks ran different micro-batches"
    # the step's loss: summed over units (TP index 0 of each), equal to the reference
    for k in range(STEPS):
        total = sum(st[k][4] for _, st, c in per_rank if c["tp"] == 0)
        assert total == pytest.approx(ref_losses[k], rel=1e-10)
    return rings


@pytest.mark.nccl_order
def test_hdp2_tp2_dense_matches_single_process():
    rings = _check(DENSE, hdp=2, tp=2)
    assert 2 in rings


@pytest.mark.nccl_order
def test_hdp3_tp2_replicated_kv_sequence_parallel_matches_single_process():
    # one KV head for TP 2: each rank computes the shared KV head from the replicated K/V weights;
    # norms on half the tokens (sequence parallelism)
    rings = _check(dataclasses.replace(DENSE, n_kv_heads=1), hdp=3, tp=2, sp=True)
    assert {2, 3} <= rings, rings


@pytest.mark.nccl_order
def test_hdp2_tp2_moe_sequence_parallel_matches_single_process():
    moe = dataclasses.replace(DENSE, n_experts=4, top_k=2, ffn_dim=24)
    _check(moe, hdp=2, tp=2, sp=True)


def test_hdp2_tp2_with_fsdp2_over_hdp_matches_single_process():
    _check(DENSE, hdp=2, tp=2, fsdp=True)
