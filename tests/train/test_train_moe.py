"""Mixtral-style MoE in bytescale's Llama: the sequence-wise router balance loss against a
brute-force formula, and HDP training (a document sharded over a ring, uneven micro-batches)
giving the gradients of single-process training on the same global batch, balance loss included
(float64)."""
from __future__ import annotations

import pytest
import torch

from bytescale.attention import Layout
from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig
from bytescale.data import IGNORE_INDEX, HDPLoader, SyntheticTokens
from bytescale.models import Llama, LlamaConfig
from bytescale.models.moe import balance_loss
from bytescale.runtime import token_level_loss
from dist_utils import run_distributed

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40,
                  n_experts=4, top_k=2, moe_ffn_dim=24, router_aux_coef=0.5)
LENGTHS = [211, 97, 13, 7, 45, 3, 130, 31, 64, 9, 150, 22, 5, 77, 1, 40]
CAPACITY = 110
TOKENS_PER_BATCH = 420
STEPS = 2


def test_balance_loss_matches_the_formula_per_document():
    torch.manual_seed(0)
    lens, E, k, G = [5, 1, 9, 4], 6, 2, 50
    probs = torch.softmax(torch.randn(sum(lens), E, dtype=torch.float64), -1)
    top = probs.topk(k, -1).indices
    got = balance_loss(probs, top, Layout.local(lens), G, k)
    want, start = 0.0, 0
    for n in lens:  # alpha-free: sum_docs (n / G) * E * sum_e f_e * P_e
        f = [sum(int(e in top[t].tolist()) for t in range(start, start + n)) / (k * n) for e in range(E)]
        p = [sum(float(probs[t, e]) for t in range(start, start + n)) / n for e in range(E)]
        want += n / G * E * sum(fe * pe for fe, pe in zip(f, p))
        start += n
    assert float(got) == pytest.approx(want, rel=1e-12)
    # a uniform router and perfectly balanced choices give E * sum_e (1/E)(1/E) = 1 per token share
    uni = torch.full((8, 4), 0.25, dtype=torch.float64)
    top = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(balance_loss(uni, top, None, 8, 2)) == pytest.approx(1.0)


def _model():
    torch.manual_seed(0)
    return Llama(CFG).double()


def _dataset():
    return SyntheticTokens(LENGTHS, vocab_size=CFG.vocab_size, seed=3)


def _loader(world, rank=0, **kw):
    # pow2: on this batch the balanced planner gives every rank the same micro-batch count
    return HDPLoader(_dataset(), PlannerConfig(CAPACITY, strategy="pow2"),
                     LoaderConfig(TOKENS_PER_BATCH, seed=5, max_steps=STEPS, **kw), rank=rank, world_size=world)


def _reference(world):
    """One process, the whole global batch as local documents; grads and aux per step (SGD between)."""
    ds = _dataset()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    out = []
    for step in _loader(world, check_plan=False, prefetch=False):
        docs = [ds.tokens(i, 0, ds.length(i)) for i in step.sample_ids]
        labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        logits, aux = model(torch.cat(docs), pos, layout=Layout.local([len(d) for d in docs]),
                            global_tokens=step.global_tokens, return_aux=True)
        (token_level_loss(logits, labels, step.global_loss_tokens) + aux).backward()
        out.append(([p.grad.clone() for p in model.parameters()], float(aux.detach())))
        opt.step()
        opt.zero_grad()
    return out


def _hdp(rank, world):
    from bytescale import HybridDataParallel

    model = HybridDataParallel(_model(), config=RuntimeConfig(bucket_cap_mb=0.01))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    out = []
    for step in _loader(world, rank):
        mbs = step.micro_batches
        aux_sum = 0.0
        for i, mb in enumerate(mbs):
            with model.micro_batch(mb, last=i == len(mbs) - 1):
                logits, aux = model(mb.input_ids, mb.position_ids, layout=mb.layout,
                                    global_tokens=step.global_tokens, return_aux=True)
                (token_level_loss(logits, mb.labels, step.global_loss_tokens) + aux).backward()
            aux_sum += float(aux.detach())
        model.finish_step()
        rings = [len(m.plan.ring) for m in mbs if m.plan.is_ring]
        out.append(([p.grad.clone() for p in model.module.parameters()], aux_sum, rings, len(mbs)))
        opt.step()
        opt.zero_grad()
    return out


def test_moe_hdp_gradients_equal_single_process_with_a_sharded_document():
    world = 3
    ref = _reference(world)
    per_rank = run_distributed(_hdp, world, timeout=300)
    for s, (ref_grads, ref_aux) in enumerate(ref):
        # the balance loss of the global batch is the sum of the ranks' shares
        assert sum(r[s][1] for r in per_rank) == pytest.approx(ref_aux, rel=1e-10)
        assert ref_aux > 0
        for r in per_rank:
            for g, want in zip(r[s][0], ref_grads):
                torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12)
    assert max(n for r in per_rank for st in r for n in st[2]) >= 2, "no document was sharded over a ring"
    assert len({tuple(st[3] for st in r) for r in per_rank}) > 1, "every rank ran the same micro-batch counts"
    router = [n for n, _ in Llama(CFG).named_parameters()].index("layers.0.moe.router.weight")
    assert ref[0][0][router].abs().max() > 0, "the router got no gradient"
