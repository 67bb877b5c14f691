"""The CUDA attention path (flash attention per ring step + bytescale's gather / scatter-add /
LSE-merge kernels) against float64 full-document attention, on one GPU.

The multi-step ring code runs through the *virtual ring* (all N positions of a ring in one
process, the same step functions the real ring calls between its exchanges). Skipped without a
GPU; multi-GPU NCCL rings cannot run on the single lent GPU (the same step code runs multi-process
on CPU in tests/test_ring_attention.py).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = [
    # (doc lens, Hq, Hkv, D)
    ([1000], 8, 2, 128),            # GQA 4:1, head dim 128
    ([777, 5, 1234, 3], 8, 1, 64),  # MQA 8:1, head dim 64, documents shorter than 2N
    ([2049, 611], 4, 4, 96),        # MHA, head dim 96
]


def _inputs(lens, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lens)
    mk = lambda h: torch.randn(t, h, d, device="cuda", dtype=torch.float64, generator=g)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq).to(dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _reference(q, k, v, dout, lens, causal):
    from bytescale.attention import reference_varlen_attention

    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = reference_varlen_attention(q, k, v, lens, causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.double()))


def _sdpa_error(q, k, v, dout, lens, causal, ref):
    """Error of torch's own bf16/fp16 attention (per document) against the same reference: the
    yardstick for what these dtypes allow."""
    import torch.nn.functional as F

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                           v[sl].transpose(0, 1), is_causal=causal, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += n
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return [_rel(a, b) for a, b in zip((out, *grads), ref)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("causal", [True, False])
def test_virtual_ring_flash_matches_float64(dtype, case, causal):
    import bytescale._C as C
    from bytescale.attention import shard_order, unshard_order, virtual_ring_attention

    lens, hq, hkv, d = CASES[case]
    q64, k64, v64, dout = _inputs(lens, hq, hkv, d, dtype, seed=case)
    q, k, v = (x.to(dtype) for x in (q64, k64, v64))
    assert C.attention.flash_usable(q)
    ref = _reference(q, k, v, dout, lens, causal)
    yard = _sdpa_error(q, k, v, dout, lens, causal, ref)
    for n in (1, 2, 3, 4, 8):
        qs, ks, vs = (shard_order(x, lens, n).requires_grad_() for x in (q, k, v))
        out = virtual_ring_attention(qs, ks, vs, lens, n, causal=causal)
        assert out.dtype == dtype and torch.isfinite(out).all()
        grads = torch.autograd.grad(out, (qs, ks, vs), shard_order(dout, lens, n))
        got = [unshard_order(x, lens, n) for x in (out, *grads)]
        for name, g, r, y in zip(("out", "dq", "dk", "dv"), got, ref, yard):
            err = _rel(g, r)
            # The ring merges per-block results (rounded to the input dtype by flash) in fp32, and
            # dk/dv add N per-block bf16 contributions: allow a few times torch's own error.
            assert err < max(4 * y, 2e-3), f"n={n} {name}: {err:.2e} vs torch's own {y:.2e}"


@pytest.fixture
def kernel_choice():
    """Sets the attention kernel choice (BYTESCALE_ATTENTION_KERNEL is read once per process);
    the previous choice is restored afterwards."""
    import bytescale._C as C

    before = C.attention.kernel_choice()
    yield C.attention.set_kernel_choice
    C.attention.set_kernel_choice(before)


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_steps_match_float64(kernel_choice, causal):
    """Long segments go to cuDNN's fused attention (one dense call per segment, GQA heads
    expanded); shorter steps of the same ring fall back to flash. Both against float64."""
    import bytescale._C as C
    from bytescale.attention import shard_order, unshard_order, virtual_ring_attention

    kernel_choice("cudnn")
    lens, hq, hkv, d = [9000, 2500], 4, 2, 128
    q64, k64, v64, dout = _inputs(lens, hq, hkv, d, torch.bfloat16, seed=21)
    q, k, v = (x.to(torch.bfloat16) for x in (q64, k64, v64))
    ref = _reference(q, k, v, dout, lens, causal)
    yard = _sdpa_error(q, k, v, dout, lens, causal, ref)
    for n in (1, 2, 4):
        qs, ks, vs = (shard_order(x, lens, n).requires_grad_() for x in (q, k, v))
        out = virtual_ring_attention(qs, ks, vs, lens, n, causal=causal)
        grads = torch.autograd.grad(out, (qs, ks, vs), shard_order(dout, lens, n))
        for name, g, r, y in zip(("out", "dq", "dk", "dv"), (out, *grads), ref, yard):
            err = _rel(unshard_order(g, lens, n), r)
            assert err < max(4 * y, 2e-3), f"n={n} {name}: {err:.2e} vs torch's own {y:.2e}"
    assert not C.attention.cudnn_failed(), "cuDNN rejected the configuration (flash was used)"


def test_fused_and_tiled_kernels_agree(kernel_choice):
    from bytescale.attention import shard_order, virtual_ring_attention

    lens = [1500, 301]
    q64, k64, v64, dout = _inputs(lens, 8, 2, 128, torch.bfloat16, seed=11)
    q, k, v = (x.to(torch.bfloat16) for x in (q64, k64, v64))
    qs, ks, vs = (shard_order(x, lens, 4) for x in (q, k, v))
    fused = virtual_ring_attention(qs, ks, vs, lens, 4)
    kernel_choice("tiled")
    tiled = virtual_ring_attention(qs, ks, vs, lens, 4)
    assert _rel(fused, tiled) < 1e-2


def test_varlen_op_uses_flash_and_matches_reference():
    from bytescale.attention import varlen_attention

    lens = [3000, 1, 17, 4096]
    q64, k64, v64, dout = _inputs(lens, 16, 4, 128, torch.bfloat16, seed=3)
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in (q64, k64, v64))
    out = varlen_attention(q, k, v, lens)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _reference(q, k, v, dout, lens, True)
    yard = _sdpa_error(q, k, v, dout, lens, True, ref)
    for g, r, y in zip((out, *grads), ref, yard):
        assert _rel(g, r) < max(2 * y, 1e-3)


def test_merge_kernel_matches_float64_and_handles_empty_rows():
    import bytescale._C as C

    t, h, d = 777, 6, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    out = torch.randn(t, h, d, device="cuda", generator=g)
    lse = torch.randn(h, t, device="cuda", generator=g)
    lse[:, :10] = float("-inf")  # rows that have seen nothing yet
    out[:10] = 0
    ob = torch.randn(t, h, d, device="cuda", generator=g).bfloat16()
    lb = torch.randn(h, t, device="cuda", generator=g)
    lb[:, 20:30] = float("-inf")  # rows this block does not reach
    lb[:, 30:35] = float("inf")  # flash's mark of a query that saw no key
    valid = torch.isfinite(lb)
    lb_v = torch.where(valid, lb, torch.full_like(lb, float("-inf"))).double()
    m = torch.where(valid, torch.maximum(lse.double(), lb_v), lse.double())
    m0 = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse.double() - m0), torch.exp(lb_v - m0)
    want_lse = torch.where(valid, m0 + torch.log(wa + wb), lse.double())
    ca = (wa / (wa + wb)).T.unsqueeze(-1)
    cb = (wb / (wa + wb)).T.unsqueeze(-1)
    want = torch.where(valid.T.unsqueeze(-1), out.double() * ca + ob.double() * cb, out.double())
    C.attention.merge_lse_(out, lse, ob, lb)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_fp32_on_cuda_uses_tiled_kernel_and_is_tight():
    from bytescale.attention import shard_order, unshard_order, virtual_ring_attention

    lens = [300, 45]
    q, k, v, dout = _inputs(lens, 4, 2, 64, torch.float32, seed=9)
    ref = _reference(q, k, v, dout, lens, True)
    qs, ks, vs = (shard_order(x.float(), lens, 3).requires_grad_() for x in (q, k, v))
    out = virtual_ring_attention(qs, ks, vs, lens, 3)
    grads = torch.autograd.grad(out, (qs, ks, vs), shard_order(dout.float(), lens, 3))
    for g, r in zip((out, *grads), ref):
        # cuBLAS may use TF32 for fp32 matmuls when allowed; the default keeps full fp32.
        assert _rel(unshard_order(g, lens, 3), r) < 1e-4
