"""torch.ops.bytescale.merge_lse_ (C.attention.merge_lse_): the log-sum-exp merge of one block's
result into running accumulators, on the CPU kernel, against the float64 formula. Rows the block
gave nothing (lse_b = -inf, or +inf: flash's mark of a query that saw no key) stay unchanged;
rows that had nothing yet (lse = -inf) take the block's values. The same reference checks the CUDA
kernel in tests/test_cuda_attention.py."""
from __future__ import annotations

import pytest
import torch

import bytescale._C as C


def _reference(out, lse, ob, lb):
    valid = torch.isfinite(lb)
    lb_v = torch.where(valid, lb, torch.full_like(lb, float("-inf"))).double()
    m = torch.where(valid, torch.maximum(lse.double(), lb_v), lse.double())
    m0 = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse.double() - m0), torch.exp(lb_v - m0)
    want_lse = torch.where(valid, m0 + torch.log(wa + wb), lse.double())
    ca = (wa / (wa + wb)).T.unsqueeze(-1)
    cb = (wb / (wa + wb)).T.unsqueeze(-1)
    want = torch.where(valid.T.unsqueeze(-1), out.double() * ca + ob.double() * cb, out.double())
    return want, want_lse


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("via_op", [False, True])
def test_merge_matches_float64_and_handles_empty_rows(block_dtype, via_op):
    t, h, d = 77, 3, 16
    g = torch.Generator().manual_seed(5)
    out = torch.randn(t, h, d, generator=g)
    lse = torch.randn(h, t, generator=g)
    lse[:, :10] = float("-inf")  # rows that have seen nothing yet
    out[:10] = 0
    ob = torch.randn(t, h, d, generator=g).to(block_dtype)
    lb = torch.randn(h, t, generator=g)
    lb[:, 5:8] = float("-inf")  # nothing before, nothing now: stays empty
    lb[:, 20:30] = float("-inf")  # rows this block does not reach
    lb[:, 30:35] = float("inf")  # flash's mark of a query that saw no key
    want, want_lse = _reference(out, lse, ob, lb)
    if via_op:
        torch.ops.bytescale.merge_lse_(out, lse, ob, lb)
    else:
        C.attention.merge_lse_(out, lse, ob, lb)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[:, 5:8]).all() and (out[5:8] == 0).all()


def test_mismatched_shapes_name_the_tensors():
    out, lse = torch.zeros(6, 2, 4), torch.zeros(2, 6)
    with pytest.raises(RuntimeError, match=r"merge_lse_: out \(T, H, D\) \[6, 2, 4\]"):
        C.attention.merge_lse_(out, lse, torch.zeros(5, 2, 4), torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="share a floating dtype"):
        C.attention.merge_lse_(out, lse.double(), torch.zeros(6, 2, 4), torch.zeros(2, 6))
