"""The HDP loader: labels and positions across zig-zag shard boundaries, resume, bad configs."""
from __future__ import annotations

import torch

from bytescale._zigzag import chunk, local_tokens
from bytescale.data.dataset import InMemoryTokens, SyntheticTokens
from bytescale.data.loader import (GlobalBatchSampler, HDPLoader, MicroBatchSpec, SequenceSpec,
                                   materialize)
from bytescale.loss import IGNORE_INDEX


def test_sharded_chunks_labels_and_positions_reassemble_the_document():
    doc = torch.arange(1000, 1000 + 23)
    ds = InMemoryTokens([doc])
    for n in (1, 2, 3, 5, 13):  # 13 ranks: 26 chunks for 23 tokens, some empty
        got_ids, got_lab = {}, {}
        total = 0
        for i in range(n):
            spec = MicroBatchSpec(local=[], sharded=[SequenceSpec(0, 23, n, i)], group=tuple(range(n)))
            mb = materialize(ds, spec)
            assert mb.num_tokens == local_tokens(23, n, i) == spec.num_tokens
            total += mb.num_tokens
            for t, l, p in zip(mb.input_ids.tolist(), mb.labels.tolist(), mb.position_ids.tolist()):
                got_ids[p], got_lab[p] = t, l
        assert total == 23
        assert [got_ids[p] for p in range(23)] == doc.tolist()
        # label of every token is the next token of the document, across chunk boundaries
        assert [got_lab[p] for p in range(23)] == doc[1:].tolist() + [IGNORE_INDEX]


def test_local_and_sharded_mixed_order():
    ds = InMemoryTokens([torch.arange(5), torch.arange(100, 110), torch.arange(200, 207)])
    spec = MicroBatchSpec(local=[SequenceSpec(0, 5), SequenceSpec(2, 7)],
                          sharded=[SequenceSpec(1, 10, 2, 1)], group=(3, 1))
    mb = materialize(ds, spec)
    a1, b1 = chunk(10, 2, 1)
    a2, b2 = chunk(10, 2, 2)
    expect = list(range(5)) + list(range(200, 207)) + list(range(100 + a1, 100 + b1)) + list(range(100 + a2, 100 + b2))
    assert mb.input_ids.tolist() == expect
    assert mb.position_ids.tolist()[:12] == list(range(5)) + list(range(7))
    assert mb.labels[4].item() == IGNORE_INDEX and mb.labels[11].item() == IGNORE_INDEX


def _round_robin_plan(world):
    def plan_fn(lengths):
        def specs_for_rank(rank):
            mine = [SequenceSpec(i, n) for i, n in enumerate(lengths) if i % world == rank]
            return [MicroBatchSpec(local=mine[j:j + 2], sharded=[]) for j in range(0, len(mine), 2)]
        return repr(lengths), specs_for_rank
    return plan_fn


def _steps(loader, k):
    return [([m.input_ids.clone() for m in s.micro_batches], s.seq_ids) for s in (next(loader) for _ in range(k))]


def test_resume_gives_identical_batches():
    ds = SyntheticTokens([7 + (i * 37) % 90 for i in range(50)], vocab_size=101, seed=3)
    for prefetch in (False, True):
        a = HDPLoader(ds, _round_robin_plan(2), tokens_per_batch=300, rank=1, world_size=2,
                      seed=5, check_plan=False, prefetch=prefetch)
        first = _steps(a, 4)
        state = a.state_dict()
        rest = _steps(a, 6)  # crosses an epoch boundary (50 seqs, ~6 per batch)
        b = HDPLoader(ds, _round_robin_plan(2), tokens_per_batch=300, rank=1, world_size=2,
                      seed=5, check_plan=False, prefetch=prefetch)
        b.load_state_dict(state)
        again = _steps(b, 6)
        assert [s for _, s in again] == [s for _, s in rest]
        for (x, _), (y, _) in zip(again, rest):
            assert all(torch.equal(p, q) for p, q in zip(x, y))
        a.close(), b.close()
        assert len(first) == 4


def test_sampler_budget_and_epochs():
    s = GlobalBatchSampler([10, 20, 30, 40], tokens_per_batch=45, seed=0)
    seen = []
    for _ in range(6):
        b = s.next_batch()
        assert b and (sum(10 * (i + 1) for i in b) <= 45 or len(b) == 1)
        seen += b
    assert sorted(seen[:4]) != [] and set(seen) == {0, 1, 2, 3}


def test_lockstep_schedule_aligns_rings_and_pads():
    from bytescale.data.loader import lockstep_schedule

    A = MicroBatchSpec(local=[], sharded=[SequenceSpec(0, 50, 2, 0)], group=(0, 2))
    B = MicroBatchSpec(local=[], sharded=[SequenceSpec(1, 50, 2, 0)], group=(1, 2))
    L = lambda i: MicroBatchSpec(local=[SequenceSpec(i, 5)], sharded=[])  # noqa: E731
    per_rank = [[A, L(3), L(4)], [B, L(5)], [A, B]]
    out = lockstep_schedule(per_rank)
    assert len({len(x) for x in out}) == 1  # same number of slots everywhere
    for k in range(len(out[0])):
        rings = {}
        for r in range(3):
            g = out[r][k].group
            if g:
                rings.setdefault(g, []).append(r)
        for g, members in rings.items():  # every member of a ring is in that ring at slot k
            assert sorted(members) == sorted(g)
    assert [m.group for m in out[2] if m.group] == [(0, 2), (1, 2)]  # ring order kept
    assert sum(1 for m in out[0] if m.local) == 2 and sum(1 for m in out[1] if m.local) == 1
