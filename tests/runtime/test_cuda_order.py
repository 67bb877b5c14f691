"""CUDA's execution model on CPU (bytescale.testing, ``BYTESCALE_NCCL_ORDER=1``): per rank, every
communication operation runs on ONE in-order queue, as on one NCCL stream, and backward runs on a
separate thread, as CUDA autograd does. These tests run in that mode whatever the environment
(they set it for their worker processes).

Issue 21, finding 1: without FSDP2, HybridDataParallel started the gradient all-reduce from grad
hooks during a rank's last micro-batch. When that micro-batch is a ring that another member runs
BEFORE more micro-batches, this rank queued the all-reduce between the ring's backward exchanges
while the member queued it after its remaining micro-batches: a cycle on one NCCL stream, a
deadlock on a GPU cluster. Here it must train, and equal single-process training.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bytescale.attention import Layout
from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig
from bytescale.data import IGNORE_INDEX, HDPLoader, SyntheticTokens
from bytescale.runtime import token_level_loss
from fixtures import TINY, tiny_llama
from dist_utils import run_distributed

CFG = TINY
WORLD, CAPACITY, STRATEGY = 3, 100, "naive"


def _ring_not_last_on_every_member(plan, world: int) -> bool:
    """A rank whose last micro-batch is a ring that some member of the ring does not run last."""
    mbs = [plan.micro_batches(r) for r in range(world)]
    for r in range(world):
        if mbs[r] and mbs[r][-1].ring:
            rid = mbs[r][-1].ring_id
            if any(not mbs[m] or mbs[m][-1].ring_id != rid for m in mbs[r][-1].ring):
                return True
    return False


def _batch_with_the_shape():
    """Document lengths whose first step plans that shape (a deterministic search)."""
    rng = np.random.default_rng(21)
    for _ in range(500):
        lengths = [int(x) for x in rng.integers(1, 260, size=int(rng.integers(4, 10)))]
        loader = HDPLoader(SyntheticTokens(lengths, vocab_size=CFG.vocab_size, seed=3),
                           PlannerConfig(CAPACITY, STRATEGY),
                           LoaderConfig(sum(lengths), seed=0, check_plan=False, prefetch=False, max_steps=1),
                           rank=0, world_size=WORLD)
        if _ring_not_last_on_every_member(next(loader).plan, WORLD):
            return lengths
    raise AssertionError("no batch with the shape found")


def _model():
    return tiny_llama(CFG)


def _loader(lengths):
    return HDPLoader(SyntheticTokens(lengths, vocab_size=CFG.vocab_size, seed=3), PlannerConfig(CAPACITY, STRATEGY),
                     LoaderConfig(sum(lengths), seed=0, max_steps=2))


def _reference(lengths):
    ds = SyntheticTokens(lengths, vocab_size=CFG.vocab_size, seed=3)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = HDPLoader(ds, PlannerConfig(CAPACITY, STRATEGY),
                       LoaderConfig(sum(lengths), seed=0, max_steps=2, check_plan=False, prefetch=False),
                       rank=0, world_size=WORLD)
    for step in loader:
        docs = [ds.tokens(i, 0, ds.length(i)) for i in step.sample_ids]
        labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        logits = model(torch.cat(docs), pos, layout=Layout.local([len(d) for d in docs]))
        token_level_loss(logits, labels, step.global_loss_tokens).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def _hdp(rank, world, lengths, via="micro_batch"):
    from bytescale import HybridDataParallel, testing
    from bytescale.runtime import StepExecutor

    assert testing.nccl_order() and testing.backward_thread_enabled()
    loader = _loader(lengths)
    # small buckets: several all-reduces start during the last backward when the order allows it
    model = HybridDataParallel(_model(), config=RuntimeConfig(bucket_cap_mb=0.005))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    shapes = []
    for step in loader:
        shapes.append(_ring_not_last_on_every_member(step.plan, world))
        if via == "executor":  # the step executor's forward / backward phases
            StepExecutor(model).run(step)
        else:
            mbs = step.micro_batches
            for i, mb in enumerate(mbs):
                with model.micro_batch(mb, last=i == len(mbs) - 1):
                    logits = model(mb.input_ids, mb.position_ids, layout=mb.layout)
                    token_level_loss(logits, mb.labels, step.global_loss_tokens).backward()
            model.finish_step()
        opt.step()
        opt.zero_grad()
    loader.close()
    return [p.detach() for p in model.module.parameters()], shapes


@pytest.mark.parametrize("via", ["micro_batch", "executor"])
def test_grad_sync_never_cycles_with_a_ring_on_one_stream(monkeypatch, via):
    """Finding 1: a deadlock (surfacing as the transport's timeout error) before the fix; with
    HybridDataParallel.micro_batch and with the step executor's separate phases."""
    monkeypatch.setenv("BYTESCALE_NCCL_ORDER", "1")
    lengths = _batch_with_the_shape()
    per_rank = run_distributed(_hdp, WORLD, lengths, via, timeout=240, pg_timeout=25)
    ref = _reference(lengths)
    assert per_rank[0][1][0], "the first step must have the shape under test"
    for params, _ in per_rank:
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-11)


def test_backward_leaves_the_callers_thread_except_under_tracing():
    """bytescale.testing's device-thread emulation: a grad hook runs on another thread, as on
    CUDA's device thread; under a dispatch mode (torch.compile's AOT autograd, opcheck), which the
    real engine hands to its device thread and a Python thread cannot receive, the backward stays
    on the caller's thread and still computes the right gradient."""
    import threading

    from torch.utils._python_dispatch import TorchDispatchMode

    from bytescale.testing import backward_on_device_thread

    class Counting(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    def hook_thread(mode):
        x = torch.randn(5, dtype=torch.float64, requires_grad=True)
        seen = []
        with mode:
            y = x * 3.0
            y.register_hook(lambda g: seen.append(threading.get_ident()))
            (grad,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(grad, torch.full_like(x, 3.0))
        return seen[0]

    import contextlib
    with backward_on_device_thread():
        assert hook_thread(contextlib.nullcontext()) != threading.get_ident()
        before = Counting.calls
        assert hook_thread(Counting()) == threading.get_ident()
        assert Counting.calls > before  # the mode saw the backward's operations
