"""Selective activation offloading (CPU engine): bit-identical gradients, checkpointing, pool reuse,
clear errors."""
from __future__ import annotations

import ctypes
import platform
import sys

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
        for layer in model.layers.values():
            layer.forward = (lambda f: (lambda x, p, lay=None: checkpoint(f, x, p, lay, use_reentrant=False)))(layer.forward)
    ctx = bytescale.offload(ratio, seq_len=T, min_bytes=1024, engine=engine)
    with ctx:
        logits = model(ids, pos, layout=Layout.local([120, 180]))
        logits.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()], ctx.stats


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_gradients_bit_identical(use_checkpoint):
    ref, _ = _grads(0.0, use_checkpoint)
    shares = []
    for ratio in (0.1, 0.25, 0.3, 0.5, 0.75, 1.0):
        g, stats = _grads(ratio, use_checkpoint)
        assert stats.offloaded_tensors > 0, "nothing was offloaded"
        assert stats.kept_tensors > 0
        shares.append(stats.offloaded_bytes / stats.eligible_bytes)
        for a, b in zip(g, ref):
            assert torch.equal(a, b)
    assert stats.shared_tensors > 0, "the q/k/v projections' common input was copied per op"
    assert shares[-1] == 1.0
    if not use_checkpoint:  # (checkpointing saves a few whole-layer inputs: a coarse split)
        assert abs(shares[3] - 0.5) < 0.15, f"ratio 0.5 offloaded {shares[3]:.2f} of the eligible bytes"


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
    # (the copy out is asynchronous, as on a GPU: a saved tensor must not be edited while it runs,
    # which autograd's version check forbids anyway; unpacking first waits for it)
    assert torch.equal(ctx._unpack(first), want)
    t.add_(1)  # edited in place: a new save must not reuse the old copy
    second = ctx._pack(t)
    assert second is not first
    assert torch.equal(ctx._unpack(first), want) and torch.equal(ctx._unpack(second), want + 1)


def test_engine_roundtrip_and_errors():
    eng = _C.offload.Engine(64 * 1024)
    x = torch.randn(37, 5, 3)
    for t in (x, x.permute(2, 0, 1), x.to(torch.bfloat16)):
        h = eng.offload(t)
        y = eng.fetch(h)
        assert torch.equal(y, t) and y.stride() == t.stride() and y.dtype == t.dtype
        assert y.data_ptr() != t.data_ptr()
    with pytest.raises(RuntimeError, match="cannot hold"):
        eng.offload(torch.randn(100_000))
    with pytest.raises(RuntimeError, match="non-overlapping dense"):
        eng.offload(torch.randn(37, 1).expand(37, 4))
    with pytest.raises(RuntimeError, match="unknown handle"):
        eng.prefetch(10_000)
    with pytest.raises(ValueError, match="ratio"):
        bytescale.offload(-0.1)


def test_whole_tensors_split_the_ratio_and_nothing_is_copied_twice():
    """The saved activations are split at pack time: whole tensors go until ``ratio`` of the
    eligible bytes went, the others stay in place as they are (the very tensor, no clone); the
    engine copies each offloaded tensor out once and back once."""
    for ratio in (0.25, 0.5, 0.75, 1.0):
        eng = _C.offload.Engine(0)
        ctx = bytescale.offload(ratio, seq_len=T, min_bytes=0, engine=eng)
        ts = [torch.randn(T, 16 * (k % 3 + 1)) for k in range(12)]
        packed = [ctx._pack(t) for t in ts]
        st = ctx.stats
        assert st.eligible_bytes == sum(t.numel() * 4 for t in ts)
        assert st.offloaded_bytes + st.kept_bytes == st.eligible_bytes
        assert abs(st.offloaded_bytes / st.eligible_bytes - ratio) <= 16 * 3 * T * 4 / 2 / st.eligible_bytes
        assert eng.offloaded_bytes == st.offloaded_bytes  # each offloaded tensor copied out once
        for t, p in zip(ts, packed):
            assert p is t or not isinstance(p, torch.Tensor)  # kept ones: the tensor itself
        for t, p in reversed(list(zip(ts, packed))):
            assert torch.equal(ctx._unpack(p), t)
        assert eng.pending == 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _in_use() -> int:
    """Bytes malloc'd and in use by the process, every thread (glibc)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


needs_glibc = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                                 reason="measures memory with glibc's mallinfo2")


@needs_glibc
def test_offloading_frees_the_tensor_and_restores_a_fresh_one():
    """The engine keeps no reference to an offloaded tensor: once its owner drops it (its copy out
    done), its memory is free; the restored tensor is one new allocation of the same size."""
    eng = _C.offload.Engine(0)
    n = 16 << 20  # 64 MiB of float32: above glibc's largest mmap threshold, so frees are exact
    t = torch.full((n // 1024, 1024), 3.0)
    h = eng.offload(t)
    y = eng.fetch(h)  # both copies done
    before = _in_use()
    del t
    freed = before - _in_use()
    assert abs(freed - 4 * n) < (1 << 20), f"dropping the offloaded tensor freed {freed} bytes, not {4 * n}"
    assert y.shape == (n // 1024, 1024) and bool((y == 3.0).all())


@needs_glibc
def test_every_ratio_keeps_fewer_bytes_resident():
    """Measured, not counted: the process's bytes in use at the end of forward (the saved
    activations and the output) fall for every ratio above 0, the host pool being warm."""
    torch.manual_seed(0)
    model = Llama(CFG).double()
    ids = torch.randint(0, CFG.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)
    eng = _C.offload.Engine(0)

    def resident(ratio):
        ctx = bytescale.offload(ratio, seq_len=T, min_bytes=1024, engine=eng)
        base = _in_use()
        with ctx:
            loss = model(ids, pos).square().mean()
            out = _in_use() - base
            loss.backward()
        return out

    for r in (0.0, 0.25, 0.5, 0.75, 1.0):  # warm the pool and the allocator
        resident(r)
    got = {r: min(resident(r) for _ in range(2)) for r in (0.0, 0.25, 0.5, 0.75, 1.0)}
    for r in (0.25, 0.5, 0.75, 1.0):
        assert got[r] < got[0.0], f"ratio {r} kept {got[r]} bytes resident, ratio 0 {got[0.0]}"
    assert got[1.0] < got[0.5] < got[0.0]


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
