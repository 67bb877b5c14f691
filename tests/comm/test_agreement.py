"""The agreement primitive (csrc/comm/agreement.h, bytescale.comm.agree): members exchange a
fixed-size digest and all get the same table; members in different kinds of agreement raise
naming both. The collective consistency check, ring attention's agreement check and the loader's
plan check are built on it (their own tests: test_comm_errors.py, tests/attention/
test_ring_agreement.py, tests/runtime/test_hdp_training.py)."""
from __future__ import annotations

import pytest

from dist_utils import run_distributed


def _rows(rank, world):
    from bytescale.comm import agree

    whole = agree([rank, 10 * rank, -rank], "test agreement")
    sub = agree([rank + 100], "test subgroup agreement", ranks=[2, 0]) if rank in (0, 2) else None
    return whole, sub


def test_every_member_gets_every_payload_in_group_order():
    world = 3
    for rank, (whole, sub) in enumerate(run_distributed(_rows, world)):
        assert [r[:3] for r in whole] == [[j, 10 * j, -j] for j in range(world)]
        assert all(len(r) == 15 and r[3:] == [0] * 12 for r in whole)
        if rank in (0, 2):
            assert [r[0] for r in sub] == [102, 100]


def _kinds(rank, world):
    from bytescale.comm import agree

    try:
        agree([1], "test kinds", kind="plan" if rank == 1 else "user")
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_members_in_different_agreements_raise_naming_both():
    for msg in run_distributed(_kinds, 2):
        assert "different agreements" in msg, msg
        assert "the loader's plan check" in msg and "bytescale.comm.agree" in msg, msg


def _too_long(rank, world):
    from bytescale.comm import agree

    with pytest.raises(ValueError, match="at most 15 values"):
        agree(list(range(16)), "too long")
    return True


def test_payload_limit_is_a_clear_error():
    assert run_distributed(_too_long, 2) == [True, True]
