"""Ring agreement: the members of a ring check that they describe the same call before any K/V
moves (csrc/attention/ring_agreement.h). A disagreement raises on EVERY member, naming the rank
and both views, instead of a silently wrong result, a hang or an abort. Real processes on the
bytescale backend, worlds 2, 3 and 5."""
from __future__ import annotations

import pytest
import torch

from bytescale.attention import reference_varlen_attention, ring_attention, shard
from dist_utils import run_distributed

HEADS = (4, 2)  # query, kv
D = 8


def _full(lens, dtype=torch.float64, heads=HEADS, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return tuple(torch.randn(t, h, d, generator=g, dtype=torch.float64).to(dtype)
                 for h in (heads[0], heads[1], heads[1]))


def _call(rank, ring, lens, **kw):
    """Runs ring attention with this rank's shard; returns None or the error's text."""
    dtype, heads, d = kw.pop("dtype", torch.float64), kw.pop("heads", HEADS), kw.pop("d", D)
    n, pos = len(ring), ring.index(rank)
    q, k, v = (shard(x, lens, n, pos) for x in _full(lens, dtype, heads, d))
    try:
        ring_attention(q, k, v, lens, ring, **kw)
        return None
    except RuntimeError as e:
        return str(e)


def _issue_case(rank, world, split, whole):
    # The last rank holds the documents split in two; the others hold one document: the same
    # token count on every rank, so only the agreement check can notice.
    ring = list(range(world))
    return _call(rank, ring, split if rank == world - 1 else whole)


@pytest.mark.parametrize("world,split,whole", [(2, [96, 96], [192]), (3, [96, 96], [192]),
                                               (5, [160, 160], [320])])
def test_documents_disagreement_raises_on_every_rank_naming_both_views(world, split, whole):
    errors = run_distributed(_issue_case, world, split, whole, timeout=120)
    odd = world - 1
    for rank, err in enumerate(errors):
        assert err is not None, f"rank {rank} returned without error"
        assert "disagree" in err and "before any K/V moved" in err, err
        assert "differ in documents" in err, err
        assert f"rank {odd} has documents {split}" in err, err
        assert f"rank 0 has documents {whole}" in err, err
        assert "BYTESCALE_CHECK_RING=0" in err


def _mismatches(rank, world):
    lens = [24, 12]  # 36 tokens: 6 per zig-zag chunk at N = 3, every position holds 12
    ring = [0, 1, 2]
    odd = rank == 1
    out = {}
    out["causal"] = _call(rank, ring, lens, causal=not odd)
    out["dtype"] = _call(rank, ring, lens, dtype=torch.float32 if odd else torch.float64)
    out["head_dim"] = _call(rank, ring, lens, d=16 if odd else D)
    out["kv_heads"] = _call(rank, ring, lens, heads=(4, 1) if odd else HEADS)
    out["scale"] = _call(rank, ring, lens, softmax_scale=0.5 if odd else None)
    out["bf16"] = _call(rank, ring, lens, bf16_grad_comm=odd)
    out["order"] = _call(rank, [2, 1, 0] if odd else ring, lens)
    # a member whose own inputs are wrong: the others learn why instead of waiting for its K/V
    n, pos = 3, ring.index(rank)
    q, k, v = (shard(x, lens, n, pos) for x in _full(lens))
    if odd:
        q, k, v = q[:-1], k[:-1], v[:-1]
    try:
        ring_attention(q, k, v, lens, ring)
        out["local"] = None
    except RuntimeError as e:
        out["local"] = str(e)
    # afterwards the ring still works: every check left the message streams in step
    full = _full(lens, seed=5)
    q, k, v = (shard(x, lens, n, pos).requires_grad_() for x in full)
    got = ring_attention(q, k, v, lens, ring)
    got.sum().backward()
    ref = shard(reference_varlen_attention(*full, lens), lens, n, pos)
    out["after"] = float((got.detach() - ref).abs().max())
    return out


def test_every_kind_of_disagreement_raises_on_every_rank():
    expect = {
        "causal": ("causal", "not causal"),
        "dtype": ("dtype", "dtype Float"),
        "head_dim": ("head dim", "head dim 16"),
        "kv_heads": ("kv heads", "1 kv heads"),
        "scale": ("softmax scale", "scale 0.5"),
        "bf16": ("bf16 dK/dV traffic", "dK/dV traffic bf16"),
        "order": ("ring order", "ring [2, 1, 0] (position 1)"),
    }
    for rank, out in enumerate(run_distributed(_mismatches, 3, timeout=180)):
        for case, (field, view) in expect.items():
            err = out[case]
            assert err is not None, f"{case}: rank {rank} returned without error"
            assert f"differ in {field}" in err, (case, err)
            assert "rank 1 has documents [24, 12]" in err and view in err, (case, err)
            assert "rank 0 has documents [24, 12]" in err, (case, err)
        local = out["local"]
        assert local is not None and "holds 12 tokens" in local and "q has 11" in local, local
        if rank != 1:
            assert "rank 1 rejected its inputs, so no K/V moved" in local, local
        assert out["after"] < 1e-10


def _agreeing(rank, world):
    # Agreeing members pass (rings of every size inside the world, any order), and the check is on.
    from bytescale.attention import ring_checks_enabled

    lens = [37, 5, 12]
    results = []
    for ring in ([r for r in range(world)], list(reversed(range(world))), [world - 1, 0]):
        if rank not in ring:
            continue
        n, pos = len(ring), ring.index(rank)
        full = _full(lens, seed=len(ring))
        q, k, v = (shard(x, lens, n, pos) for x in full)
        got = ring_attention(q, k, v, lens, ring)
        ref = shard(reference_varlen_attention(*full, lens), lens, n, pos)
        results.append(float((got - ref).abs().max()))
    return ring_checks_enabled(), results


@pytest.mark.parametrize("world", [2, 5])
def test_agreeing_members_pass(world):
    for on, errs in run_distributed(_agreeing, world, timeout=180):
        assert on and errs and max(errs) < 1e-10


def _switched_off(rank, world, how):
    from bytescale.attention import ring_checks_enabled, set_ring_checks

    if how == "setter":
        set_ring_checks(False)
    off = not ring_checks_enabled()
    err = _issue_case(rank, world, [96, 96], [192])
    if how == "setter":
        set_ring_checks(True)
    return off, err


@pytest.mark.parametrize("how", ["setter", "env"])
def test_off_switch_restores_the_unchecked_behaviour(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv("BYTESCALE_CHECK_RING", "0")  # the spawned ranks inherit it
    for off, err in run_distributed(_switched_off, 3, how, timeout=120):
        # unchecked, the disagreement goes unnoticed (the silent wrong result the check prevents)
        assert off and err is None


def _agreements_per_micro_batch(rank, world):
    from bytescale import _C
    from bytescale.attention import Layout, micro_batch_context

    lens, ring = [40, 17], list(range(world))
    n, pos = len(ring), ring.index(rank)
    q, k, v = (shard(x, lens, n, pos).requires_grad_() for x in _full(lens))
    count = _C.attention.ring_agreement_exchanges
    c0 = count()
    for _ in range(3):  # outside a micro-batch: every call is checked
        ring_attention(q, k, v, lens, ring)
    outside = count() - c0
    c1 = count()
    with micro_batch_context(Layout(sharded_lens=tuple(lens), ring=tuple(ring), ring_pos=pos)):
        outs = [ring_attention(q, k, v, lens, ring) for _ in range(3)]  # "three layers"
        ring_attention(q, k, v, lens, ring, softmax_scale=0.5)  # another signature: checked once
        torch.stack(outs).sum().backward()  # the backward exchanges K/V, never a digest
    inside = count() - c1
    with micro_batch_context(None):  # the next micro-batch: checked again
        ring_attention(q, k, v, lens, ring)
    return outside, inside, count() - c1 - inside


def test_agreement_runs_once_per_micro_batch_and_signature():
    """Issue 21, finding 7: the check is a blocking host round trip on CUDA; inside a micro-batch
    (micro_batch_context, which HybridDataParallel enters) later layers and the recompute of
    the same ring call skip it."""
    for outside, inside, next_mb in run_distributed(_agreements_per_micro_batch, 3, timeout=120):
        assert (outside, inside, next_mb) == (3, 2, 1)
