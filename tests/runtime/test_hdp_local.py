"""HDP training with local documents only: uneven micro-batch counts (zero included) across ranks
give the same parameters as single-process training on the whole global batch."""
from __future__ import annotations

import pytest
import torch

from bytescale.attention import Layout
from bytescale.config import RuntimeConfig
from bytescale.data import IGNORE_INDEX, MicroBatch
from bytescale.planner import DocRef, MicroBatchPlan
from bytescale.runtime import token_level_loss
from bytescale.models import Llama, LlamaConfig
from dist_utils import run_distributed

CFG = LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
STEPS = 3


def _docs(step: int):
    g = torch.Generator().manual_seed(step)
    lens = [17, 5, 33, 1, 12, 9, 26]
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g) for n in lens]


def _labels(doc):
    return torch.cat([doc[1:], torch.tensor([IGNORE_INDEX])])


def _model():
    torch.manual_seed(0)
    return Llama(CFG).double()


def _reference():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        docs = _docs(step)
        ids = torch.cat(docs)
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        labels = torch.cat([_labels(d) for d in docs])
        logits = model(ids, pos, layout=Layout.local([len(d) for d in docs]))
        ntok = int((labels != IGNORE_INDEX).sum())
        token_level_loss(logits, labels, ntok).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def _assignment(world: int, step: int):
    """Documents -> (rank, micro-batch) with uneven counts; rank world-1 gets nothing at step 1."""
    docs = list(range(7))
    out = {r: [] for r in range(world)}
    for i, d in enumerate(docs):
        r = (i + step) % world
        if step == 1 and r == world - 1 and world > 1:
            r = 0
        out[r].append(d)
    # split each rank's docs into micro-batches of at most 2 docs
    return {r: [ds[j:j + 2] for j in range(0, len(ds), 2)] for r, ds in out.items()}


def _hdp(rank: int, world: int):
    from bytescale import HybridDataParallel

    model = HybridDataParallel(_model(), config=RuntimeConfig(bucket_cap_mb=0.001))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        docs = _docs(step)
        global_tokens = sum(int((_labels(d) != IGNORE_INDEX).sum()) for d in docs)
        mbs = _assignment(world, step)[rank]
        for i, ids_ in enumerate(mbs):
            ds = [docs[j] for j in ids_]
            ids = torch.cat(ds)
            pos = torch.cat([torch.arange(len(d)) for d in ds])
            labels = torch.cat([_labels(d) for d in ds])
            plan = MicroBatchPlan(rank, i, local=tuple(DocRef(j, j, len(docs[j])) for j in ids_))
            mb = MicroBatch(ids, labels, pos, plan, plan.layout())
            with model.micro_batch(mb, last=(i == len(mbs) - 1)):
                token_level_loss(model(ids, pos, layout=mb.layout), labels, global_tokens).backward()
        model.finish_step()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.module.parameters()]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_hdp_local_docs_match_single_process(world):
    ref = _reference()
    for params in run_distributed(_hdp, world):
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-11)
