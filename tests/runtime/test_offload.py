"""Selective activation offloading (CPU engine): bit-identical gradients, checkpointing, pool reuse,
clear errors."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import bytescale
from bytescale import _C
from bytescale.attention import Layout
from bytescale.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=97, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96)
T = 300


def _grads(ratio, use_checkpoint=False, engine=None):
    torch.manual_seed(0)
    model = Llama(CFG).double()
    ids = torch.randint(0, CFG.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(120), torch.arange(180)])
    if use_checkpoint:
        for layer in model.layers:
            layer.forward = (lambda f: (lambda x, p, lay=None: checkpoint(f, x, p, lay, use_reentrant=False)))(layer.forward)
    ctx = bytescale.offload(ratio, seq_len=T, min_bytes=1024, engine=engine)
    with ctx:
        logits = model(ids, pos, layout=Layout.local([120, 180]))
        logits.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()], ctx.stats


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_gradients_bit_identical(use_checkpoint):
    ref, _ = _grads(0.0, use_checkpoint)
    for ratio in (0.3, 0.5, 1.0):
        g, stats = _grads(ratio, use_checkpoint)
        assert stats.offloaded_tensors > 0, "nothing was offloaded"
        assert stats.shared_tensors > 0, "the q/k/v projections' common input was copied per op"
        for a, b in zip(g, ref):
            assert torch.equal(a, b)


def test_pool_reuse_has_no_growth():
    eng = _C.offload.Engine(0)
    _grads(0.5, engine=eng)
    reserved = eng.pool_reserved_bytes
    assert reserved > 0 and eng.pool_in_use_bytes == 0 and eng.pending == 0
    for _ in range(5):
        _grads(0.5, engine=eng)
    assert eng.pool_reserved_bytes == reserved
    assert eng.pool_in_use_bytes == 0


def test_step_releases_restored_activations_without_gc():
    """A step's restored activations die with its autograd graph, not at the next cyclic GC:
    on a GPU nothing triggers the GC under memory pressure (seen as an OOM on an H200)."""
    import gc

    eng = _C.offload.Engine(0)
    lin = torch.nn.Linear(64, 64)
    gc.disable()
    try:
        def step():
            x = torch.randn(T, 64, requires_grad=True)
            ctx = bytescale.offload(0.5, seq_len=T, min_bytes=1024, engine=eng)
            with ctx:
                h = x
                for _ in range(3):
                    h = torch.relu(lin(h))
                h.sum().backward()
            assert ctx.stats.offloaded_tensors > 0
            return ctx

        ctx = step()
        assert all(ref() is None for ref in ctx._packed), "handles (and their tensors) outlived the graph"
        assert eng.pending == 0 and eng.pool_in_use_bytes == 0

        # forward only (no backward): dropping the graph returns every entry and host buffer
        x = torch.randn(T, 64, requires_grad=True)
        with bytescale.offload(1.0, seq_len=T, min_bytes=1024, engine=eng):
            out = torch.relu(lin(torch.relu(lin(x))))
        assert eng.pending > 0 and eng.pool_in_use_bytes > 0
        del out
        assert eng.pending == 0 and eng.pool_in_use_bytes == 0
    finally:
        gc.enable()


def test_shared_saves_are_one_copy_but_never_alias_an_edited_tensor():
    ctx = bytescale.offload(0.5, seq_len=T, min_bytes=0, engine=_C.offload.Engine(0))
    t = torch.randn(T, 8)
    first = ctx._pack(t)
    assert ctx._pack(t) is first and ctx.stats.shared_tensors == 1  # same tensor: one copy
    assert ctx._pack(t.clone()) is not first  # equal values, another tensor
    want = t.clone()
    t.add_(1)  # edited in place: a new save must not reuse the old copy
    second = ctx._pack(t)
    assert second is not first
    assert torch.equal(ctx._unpack(first), want) and torch.equal(ctx._unpack(second), want + 1)


def test_engine_roundtrip_and_errors():
    eng = _C.offload.Engine(64 * 1024)
    x = torch.randn(37, 5, 3)
    for ratio in (0.0, 0.1, 0.5, 1.0):
        h = eng.offload(x, ratio)
        assert torch.equal(eng.fetch(h), x)
    with pytest.raises(RuntimeError, match="cannot hold"):
        eng.offload(torch.randn(100_000), 1.0)
    with pytest.raises(RuntimeError, match="ratio"):
        eng.offload(x, 1.5)
    with pytest.raises(RuntimeError, match="unknown handle"):
        eng.prefetch(10_000)
    with pytest.raises(ValueError, match="ratio"):
        bytescale.offload(-0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offload_bit_identical():
    torch.manual_seed(0)
    model = Llama(CFG).cuda()
    ids = torch.randint(0, CFG.vocab_size, (T,), device="cuda")
    pos = torch.arange(T, device="cuda")
    grads = []
    for ratio in (0.0, 0.5, 1.0):
        model.zero_grad()
        with bytescale.offload(ratio, seq_len=T, min_bytes=1024):
            model(ids, pos).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(g, grads[0]))
