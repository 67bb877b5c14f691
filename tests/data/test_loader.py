"""The HDP loader: labels and positions across zig-zag shard boundaries, resume, bad configs."""
from __future__ import annotations

import pytest
import torch

from bytescale.attention import zigzag
from bytescale.config import LoaderConfig, PlannerConfig
from bytescale.data import IGNORE_INDEX, GlobalBatchSampler, HDPLoader, materialize
from bytescale.data.dataset import InMemoryTokens, SyntheticTokens
from bytescale.planner import DocRef, MicroBatchPlan


def _ring_plan(rank, n, length, sample_id=0, ring=None, ring_id=0):
    ring = tuple(range(n)) if ring is None else ring
    return MicroBatchPlan(rank=ring[rank], index=0, sharded=(DocRef(0, sample_id, length),),
                          ring=ring, ring_pos=rank, ring_id=ring_id)


def test_sharded_chunks_labels_and_positions_reassemble_the_document():
    doc = torch.arange(1000, 1000 + 23)
    ds = InMemoryTokens([doc])
    for n in (1, 2, 3, 5, 13):  # 13 ranks: 26 chunks for 23 tokens, some empty
        got_ids, got_lab = {}, {}
        total = 0
        for i in range(n):
            spec = _ring_plan(i, n, 23)
            mb = materialize(ds, spec)
            assert mb.num_tokens == zigzag.local_tokens(23, n, i) == spec.num_tokens == mb.layout.num_tokens
            total += mb.num_tokens
            for t, l, p in zip(mb.input_ids.tolist(), mb.labels.tolist(), mb.position_ids.tolist()):
                got_ids[p], got_lab[p] = t, l
        assert total == 23
        assert [got_ids[p] for p in range(23)] == doc.tolist()
        # label of every token is the next token of the document, across chunk boundaries
        assert [got_lab[p] for p in range(23)] == doc[1:].tolist() + [IGNORE_INDEX]


def test_local_and_sharded_mixed_order():
    ds = InMemoryTokens([torch.arange(5), torch.arange(100, 110), torch.arange(200, 207)])
    spec = MicroBatchPlan(rank=1, index=0, local=(DocRef(0, 0, 5), DocRef(2, 2, 7)),
                          sharded=(DocRef(1, 1, 10),), ring=(3, 1), ring_pos=1, ring_id=0)
    mb = materialize(ds, spec)
    a1, b1 = zigzag.chunk(10, 2, 1)
    a2, b2 = zigzag.chunk(10, 2, 2)
    expect = list(range(5)) + list(range(200, 207)) + list(range(100 + a1, 100 + b1)) + list(range(100 + a2, 100 + b2))
    assert mb.input_ids.tolist() == expect
    assert mb.position_ids.tolist()[:12] == list(range(5)) + list(range(7))
    assert mb.labels[4].item() == IGNORE_INDEX and mb.labels[11].item() == IGNORE_INDEX
    assert mb.layout.local_lens == (5, 7) and mb.layout.sharded_lens == (10,) and mb.layout.ring == (3, 1)


def test_unbound_plan_is_rejected():
    ds = InMemoryTokens([torch.arange(5)])
    with pytest.raises(ValueError, match="no sample id"):
        materialize(ds, MicroBatchPlan(rank=0, index=0, local=(DocRef(0, -1, 5),)))


def _steps(loader, k):
    return [([m.input_ids.clone() for m in s.micro_batches], s.sample_ids) for s in (next(loader) for _ in range(k))]


def test_resume_gives_identical_batches():
    ds = SyntheticTokens([7 + (i * 37) % 90 for i in range(50)], vocab_size=101, seed=3)
    planner = PlannerConfig(capacity=64)
    for prefetch in (False, True):
        cfg = LoaderConfig(tokens_per_batch=300, seed=5, check_plan=False, prefetch=prefetch)
        a = HDPLoader(ds, planner, cfg, rank=1, world_size=2)
        first = _steps(a, 4)
        state = a.state_dict()
        rest = _steps(a, 6)  # crosses an epoch boundary (50 seqs, ~6 per batch)
        b = HDPLoader(ds, planner, cfg, rank=1, world_size=2)
        b.load_state_dict(state)
        again = _steps(b, 6)
        assert [s for _, s in again] == [s for _, s in rest]
        for (x, _), (y, _) in zip(again, rest):
            assert all(torch.equal(p, q) for p, q in zip(x, y))
        a.close(), b.close()
        assert len(first) == 4


def test_loader_always_attaches_layouts_matching_the_plan():
    ds = SyntheticTokens([7 + (i * 37) % 90 for i in range(40)], vocab_size=101, seed=3)
    world = 3
    loaders = [HDPLoader(ds, PlannerConfig(capacity=40), LoaderConfig(tokens_per_batch=400, check_plan=False),
                         rank=r, world_size=world) for r in range(world)]
    steps = [next(ld) for ld in loaders]
    tokens = 0
    for r, st in enumerate(steps):
        for mb in st.micro_batches:
            assert mb.layout == mb.plan.layout() and mb.layout.num_tokens == mb.num_tokens
            assert all(d.sample_id == st.sample_ids[d.batch_pos] for d in mb.plan.documents)
            if mb.plan.is_ring:
                assert mb.layout.ring[mb.layout.ring_pos] == r
            tokens += mb.num_tokens
    assert tokens == steps[0].global_tokens  # every token of the global batch exactly once
    for ld in loaders:
        ld.close()


def test_loader_rejects_untyped_configuration():
    ds = InMemoryTokens([torch.arange(5)])
    with pytest.raises(TypeError, match="PlannerConfig"):
        HDPLoader(ds, lambda lengths: None, LoaderConfig(tokens_per_batch=5), rank=0, world_size=1)
    with pytest.raises(ValueError, match="tokens_per_batch"):
        LoaderConfig(tokens_per_batch=0)
    with pytest.raises(ValueError, match="capacity"):
        PlannerConfig(capacity=1.5)
    with pytest.raises(ValueError, match="rank 2"):
        HDPLoader(ds, PlannerConfig(capacity=8), LoaderConfig(tokens_per_batch=5), rank=2, world_size=2)


def test_sampler_budget_and_epochs():
    s = GlobalBatchSampler([10, 20, 30, 40], tokens_per_batch=45, seed=0)
    seen = []
    for _ in range(6):
        b = s.next_batch()
        assert b and (sum(10 * (i + 1) for i in b) <= 45 or len(b) == 1)
        seen += b
    assert sorted(seen[:4]) != [] and set(seen) == {0, 1, 2, 3}


@pytest.mark.parametrize("world", [2, 3, 5])
def test_lockstep_slots_align_rings_and_pad(world):
    """FSDP2 lockstep (the plan's C++ slots): same number of slots everywhere, ring members in the
    same slot, ring order and every micro-batch kept."""
    from bytescale.planner import plan

    lengths = [211, 97, 13, 7, 45, 3, 130, 31, 64, 9, 150, 22, 5, 77, 1, 40]
    p = plan(lengths, world_size=world, capacity=-(-max(lengths) // world) + 10)
    out = [p.lockstep_micro_batches(r) for r in range(world)]
    assert len({len(x) for x in out}) == 1  # same number of slots everywhere
    for k in range(len(out[0])):
        rings = {}
        for r in range(world):
            assert out[r][k].index == k and out[r][k].rank == r
            if out[r][k].ring:
                rings.setdefault((out[r][k].ring, out[r][k].ring_id), []).append(r)
        for (g, _), members in rings.items():  # every member of a ring is in that ring at slot k
            assert sorted(members) == sorted(g)
    for r in range(world):
        real = p.micro_batches(r)
        kept = [m for m in out[r] if not m.is_empty]
        key = lambda m: (m.ring_id, [d.batch_pos for d in m.documents])  # noqa: E731
        assert sorted(map(key, kept)) == sorted(map(key, real))
        assert [m.ring_id for m in kept if m.is_ring] == [m.ring_id for m in real if m.is_ring]
