"""Ring attention on dynamic groups against float64 attention on the full documents.

Every rank builds the same full documents (seeded), keeps its zig-zag shard, runs ring attention
over the group with real processes and the bytescale backend, and compares its output and q/k/v
gradients with the shards of plain full-document attention (bytescale.attention.reference_varlen_attention).
"""
from __future__ import annotations

import pytest
import torch

from bytescale.attention import reference_varlen_attention
from bytescale.attention import Layout, ring_attention, shard, unshard, varlen_attention
from dist_utils import run_distributed

CASES = [
    # (sharded doc lengths, local doc lengths, Hq, Hkv, D, causal)
    ([37], [], 4, 4, 16, True),
    ([101, 3, 58], [9, 1], 8, 2, 8, True),   # GQA 4:1, docs shorter than 2N, local + sharded
    ([64, 17], [5], 8, 1, 16, False),         # MQA 8:1, non-causal
    ([1, 2], [], 2, 2, 8, True),              # every doc shorter than 2N for N >= 2
    ([211, 46], [29], 4, 2, 128, True),       # head dim 128 (Llama-class), GQA 2:1
    ([173], [], 8, 1, 64, False),             # head dim 64, MQA, non-causal
]


def _full(seed, lens, hq, hkv, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    mk = lambda h: torch.randn(T, h, d, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _ring_case(rank, world, ranks, case, seed, dtype):
    sh_lens, loc_lens, hq, hkv, d, causal = case
    if rank not in ranks:
        return None
    n, pos = len(ranks), ranks.index(rank)
    q, k, v, dout = _full(seed, sh_lens, hq, hkv, d)
    ql, kl, vl, doutl = _full(seed + 1000 * rank, loc_lens, hq, hkv, d)  # this rank's own local docs
    # inputs of this rank: local docs, then its shard of the sharded docs
    qs = torch.cat([ql, shard(q, sh_lens, n, pos)]).to(dtype).requires_grad_()
    ks = torch.cat([kl, shard(k, sh_lens, n, pos)]).to(dtype).requires_grad_()
    vs = torch.cat([vl, shard(v, sh_lens, n, pos)]).to(dtype).requires_grad_()
    ds = torch.cat([doutl, shard(dout, sh_lens, n, pos)]).to(dtype)
    layout = Layout.for_rank(loc_lens, sh_lens, ranks)
    out = layout.attention(qs, ks, vs, causal=causal)
    gq, gk, gv = torch.autograd.grad(out, (qs, ks, vs), ds)
    # references in float64 on the full documents
    outs, grads = [], []
    for qq, kk, vv, dd, lens, sel in ((ql, kl, vl, doutl, loc_lens, None), (q, k, v, dout, sh_lens, (n, pos))):
        if not lens:
            continue
        qq, kk, vv = (t.clone().requires_grad_() for t in (qq, kk, vv))
        r = reference_varlen_attention(qq, kk, vv, lens, causal=causal)
        rg = torch.autograd.grad(r, (qq, kk, vv), dd)
        if sel is not None:
            r = shard(r, lens, *sel)
            rg = tuple(shard(t, lens, *sel) for t in rg)
        outs.append(r.detach())
        grads.append(rg)
    ref_out = torch.cat(outs)
    ref_g = [torch.cat([g[i] for g in grads]) for i in range(3)]
    return (out.detach().double(), ref_out, [t.double() for t in (gq, gk, gv)], ref_g)


def _run_all(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    results = []
    groups = [list(range(world)), list(reversed(range(world)))]
    if world >= 3:
        groups.append([world - 1, 0])  # a 2-member ring inside a larger world
    for gi, ranks in enumerate(groups):
        for ci, case in enumerate(CASES):
            results.append(_ring_case(rank, world, ranks, case, 10 * gi + ci, dtype))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ring_attention_matches_float64_reference(world):
    per_rank = run_distributed(_run_all, world, "float64", timeout=300)
    checked = 0
    for results in per_rank:
        for res in results:
            if res is None:
                continue
            out, ref, g, rg = res
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
            for a, b in zip(g, rg):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
            checked += 1
    assert checked > 0


def test_ring_attention_fp32_and_bf16_tolerances():
    per_rank = run_distributed(_run_all, 3, "float32", timeout=300)
    for results in per_rank:
        for res in results:
            if res is None:
                continue
            out, ref, g, rg = res
            torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
            for a, b in zip(g, rg):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    per_rank = run_distributed(_run_all, 2, "bfloat16", timeout=300)
    for results in per_rank:
        for res in results:
            if res is None:
                continue
            out, ref, g, rg = res
            # bf16 inputs (8-bit mantissa): outputs within 3e-2, gradients within 6e-2 (abs)
            torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
            for a, b in zip(g, rg):
                torch.testing.assert_close(a, b, rtol=6e-2, atol=6e-2)


def _determinism(rank, world):
    case = CASES[1]
    a = _ring_case(rank, world, list(range(world)), case, 3, torch.float32)
    b = _ring_case(rank, world, list(range(world)), case, 3, torch.float32)
    return all(torch.equal(x, y) for x, y in zip([a[0]] + a[2], [b[0]] + b[2]))


def test_ring_attention_is_deterministic():
    assert all(run_distributed(_determinism, 3))


def _bf16_grad_comm(rank, world):
    lens, hq, hkv, d = [300, 41], 4, 2, 32
    q, k, v, dout = _full(7, lens, hq, hkv, d)
    ranks = list(range(world))
    xs = [shard(x, lens, world, rank).float().requires_grad_() for x in (q, k, v)]
    ds = shard(dout, lens, world, rank).float()
    grads = {}
    for bf16 in (False, True):
        out = ring_attention(*xs, lens, ranks, bf16_grad_comm=bf16)
        grads[bf16] = torch.autograd.grad(out, xs, ds)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_varlen_attention(qq, kk, vv, lens), (qq, kk, vv), dout)
    ref = [shard(t, lens, world, rank) for t in ref]
    return [g.double() for g in grads[False]], [g.double() for g in grads[True]], ref


def test_bf16_gradient_communication():
    """dK/dV accumulators travelling as bf16: dQ (local) is unchanged bit for bit; dK/dV differ
    from the fp32 traffic by bf16 rounding only."""
    for fp32, bf16, ref in run_distributed(_bf16_grad_comm, 3, timeout=300):
        assert torch.equal(fp32[0], bf16[0])
        for name, a, b, r in zip(("dk", "dv"), fp32[1:], bf16[1:], ref[1:]):
            rel = lambda x: ((x - r).norm() / r.norm()).item()  # noqa: E731
            assert rel(a) < 1e-5, name
            assert 1e-6 < rel(b) < 1e-2, f"{name}: {rel(b):.2e} (bf16 traffic should round, slightly)"


def test_shard_unshard_roundtrip_and_layout_errors():
    lens = [7, 1, 30]
    x = torch.arange(sum(lens))
    for n in (1, 2, 3, 5):
        assert torch.equal(unshard([shard(x, lens, n, p) for p in range(n)], lens), x)
    lay = Layout.for_rank([3], [10], ring=[4, 2], rank=2)
    assert lay.ring_pos == 1 and lay.num_tokens == 3 + 5
    with pytest.raises(ValueError, match="not in the ring"):
        Layout.for_rank([], [10], ring=[0, 1], rank=5)
    with pytest.raises(ValueError, match="need a ring"):
        Layout(local_lens=(3,), sharded_lens=(10,))
    with pytest.raises(ValueError, match="layout holds"):
        lay.attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))
    with pytest.raises(RuntimeError, match="multiple of"):
        varlen_attention(torch.randn(5, 3, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), [5])
    with pytest.raises(RuntimeError, match="sum to"):
        varlen_attention(torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), [4])


@pytest.mark.parametrize("fn", ["varlen", "virtual"])
def test_bad_inputs_name_what_is_wrong(fn):
    from bytescale.attention import virtual_ring_attention

    def call(q, k, v):
        if fn == "varlen":
            return varlen_attention(q, k, v, [q.shape[0]])
        return virtual_ring_attention(q, k, v, [q.shape[0]], 2)

    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    bad = [
        ((torch.randn(6, 32), k, v), r"\(tokens, heads, head_dim\), got q \[6, 32\]"),
        ((q, k, torch.randn(6, 1, 8)), "differ in shape"),
        ((q, torch.randn(6, 2, 4), torch.randn(6, 2, 4)), r"head_dim of q \(8\)"),
        ((q, k.double(), v), "dtypes differ"),
        ((q.long(), k.long(), v.long()), "floating-point"),
        ((q, torch.randn(5, 2, 8), torch.randn(5, 2, 8)), "q has 6 tokens but k has 5"),
    ]
    for args, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            call(*args)
    # the backward checks the output gradient against q
    qg = q.clone().requires_grad_()
    out = call(qg, k, v)
    with pytest.raises(RuntimeError, match="size|shape|output gradient"):
        out.backward(torch.randn(5, 4, 8))


def test_opcheck_and_compile():
    q = torch.randn(12, 4, 8, requires_grad=True)
    k = torch.randn(12, 2, 8, requires_grad=True)
    v = torch.randn(12, 2, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.bytescale.varlen_attn_fwd.default, (q, k, v, [5, 7], True, 0.0))
    f = torch.compile(lambda a, b, c: varlen_attention(a, b, c, [5, 7]).sum(), backend="eager", fullgraph=True)
    f(q, k, v).backward()
    assert q.grad is not None


def test_virtual_ring_matches_reference():
    """The virtual ring (all positions in one process, the same step code as the real ring):
    outputs and gradients against float64 full-document attention, causal and not."""
    from bytescale.attention import shard_order, unshard_order, virtual_ring_attention

    lens = [61, 3, 130]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(sum(lens), 4, 8, generator=g, dtype=torch.float64)
    for causal in (True, False):
        ref = reference_varlen_attention(q, k, v, lens, causal=causal)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
        for n in (1, 2, 3, 8):
            qs, ks, vs = (shard_order(x.detach(), lens, n).requires_grad_() for x in (q, k, v))
            out = virtual_ring_attention(qs, ks, vs, lens, n, causal=causal)
            torch.testing.assert_close(unshard_order(out, lens, n), ref, rtol=1e-10, atol=1e-10)
            grads = torch.autograd.grad(out, (qs, ks, vs), shard_order(dout, lens, n))
            for got, want in zip(grads, ref_grads):
                torch.testing.assert_close(unshard_order(got, lens, n), want, rtol=1e-9, atol=1e-9)
