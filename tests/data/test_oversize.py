"""Documents no plan of the mesh can hold (LoaderConfig.oversize): the planner's rule, found before
the first step for a dataset and a token store, per drawn document for the data service; resume
across world sizes under each option.

References: the planner itself (a batch of one document of L tokens plans, one of L + 1 is refused),
the documents' own tokens (every piece read back against the base), and uninterrupted runs.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from bytescale.config import LoaderConfig, PlannerConfig
from bytescale.data import (DataService, DocumentView, HDPLoader, InMemoryTokens, OversizeError, TokenStore,
                            TokenStoreWriter)
from bytescale.planner import documents_fit, longest_document, plan

CAP = 37
# lengths divisible by nothing; 400 and 1000 exceed 3 x 37 = 111 and 5 x 37 = 185; 150 only the first
LENGTHS = [23, 400, 5, 61, 150, 17, 1000, 90, 3, 111, 44, 71, 29, 112]
BUDGET = 200


def _tokens(n: int, doc: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.long) * 7 + doc * 13) % 251


def _dataset() -> InMemoryTokens:
    return InMemoryTokens([_tokens(n, i) for i, n in enumerate(LENGTHS)])


def _loader(source, world, mode="split", capacity=CAP, rank=0, **kw):
    return HDPLoader(source, PlannerConfig(capacity, **kw),
                     LoaderConfig(BUDGET, seed=3, oversize=mode, prefetch=False, check_plan=False),
                     rank=rank, world_size=world)


# -- the planner's rule ----------------------------------------------------------------------------

SLOW_COPIES = {"a1": 1e-3, "b1": 0.1, "g": 1e-9, "a2": 1.0, "b2": 0.0, "layers": 8, "bw_d2h": 1.0, "bw_h2d": 1.0}


@pytest.mark.parametrize("units,kw", [
    (1, {}), (2, {}), (3, {}), (5, {}),
    (3, {"memory": (1.0, 2.5, 1.0)}),
    (3, {"offload": True}), (5, {"offload": True, "offload_rule": "paper-eq3"}),
    (15, {"offload": True, "cost": SLOW_COPIES, "capacity": 16}),
    (6, {"strategy": "static"}), (3, {"strategy": "static"}), (6, {"strategy": "static", "static_cp": 2}),
    (3, {"strategy": "pp-balance", "pp": 2}),
])
def test_longest_document_is_where_the_planner_starts_refusing(units, kw):
    cfg = PlannerConfig(**{"capacity": CAP, **kw})
    limit = longest_document(cfg, units)
    plan([limit, 1], units, cfg.capacity, cfg.strategy, cfg.offload, cfg.cost, memory=cfg.memory,
         static_cp=cfg.static_cp, pp=cfg.pp, offload_rule=cfg.offload_rule)
    with pytest.raises(ValueError):
        plan([limit + 1], units, cfg.capacity, cfg.strategy, cfg.offload, cfg.cost, memory=cfg.memory,
             static_cp=cfg.static_cp, pp=cfg.pp, offload_rule=cfg.offload_rule)
    # every shorter length plans: brute force against the planner (sampled densely below the limit)
    for s in sorted(set(np.linspace(1, limit, 60).astype(int).tolist())):
        plan([s], units, cfg.capacity, cfg.strategy, cfg.offload, cfg.cost, memory=cfg.memory,
             static_cp=cfg.static_cp, pp=cfg.pp, offload_rule=cfg.offload_rule)
    assert documents_fit(cfg, units, np.arange(1, limit + 1)).all()


def test_a_floor_that_is_not_monotone_stops_the_limit_at_its_first_gap():
    """Where copies cannot hide all activations Eq. 3's floor is a concave quadratic in the length: a
    length can fail while a longer one fits. The limit is the first failure, exactly."""
    cfg = PlannerConfig(16, offload=True, cost=SLOW_COPIES)
    limit = longest_document(cfg, 15)
    fits = [_plans(cfg, 15, s) for s in range(1, 1100)]
    first_fail = fits.index(False) + 1
    assert limit == first_fail - 1
    assert any(fits[first_fail:]), "the cost model was meant to have a gap"
    assert documents_fit(cfg, 15, np.arange(1, 1100)).tolist() == fits


def _plans(cfg, units, s) -> bool:
    try:
        plan([s], units, cfg.capacity, offload=cfg.offload, cost=cfg.cost)
        return True
    except ValueError:
        return False


# -- a dataset and a token store: before the first step ----------------------------------------------

def _epoch(loader, steps=40):
    out = []
    for _, step in zip(range(steps), loader):
        out.append((tuple(step.sample_ids), tuple(step.batch.lengths)))
    return out


def test_split_keeps_every_token_and_each_piece_fits():
    ds = _dataset()
    loader = _loader(ds, 3)
    assert loader.limit == 3 * CAP
    view = loader.source.dataset
    assert isinstance(view, DocumentView) and view.lengths.max() <= loader.limit
    for doc, n in enumerate(LENGTHS):  # the pieces of a document, in order, are the document
        mine = np.flatnonzero(view.doc == doc)
        got = torch.cat([view.tokens(int(i), 0, view.length(int(i))) for i in mine])
        assert torch.equal(got, _tokens(n, doc))
    for ids, lens in _epoch(loader, 12):
        assert max(lens) <= loader.limit
        assert list(lens) == [int(view.lengths[i]) for i in ids]


def test_materialized_pieces_read_the_right_tokens_on_every_rank():
    world = 3
    loaders = [_loader(_dataset(), world, rank=r) for r in range(world)]
    view = loaders[0].source.dataset
    for _ in range(8):
        steps = [next(l) for l in loaders]
        tokens = 0
        for st in steps:
            for mb in st.micro_batches:
                tokens += mb.input_ids.numel()
                for doc, a, b in mb.plan.token_ranges():
                    want = view.tokens(doc.sample_id, a, b)
                    base = view.base.tokens(int(view.doc[doc.sample_id]), int(view.start[doc.sample_id]) + a,
                                            int(view.start[doc.sample_id]) + b)
                    assert torch.equal(want, base)
        assert tokens == sum(steps[0].batch.lengths)


def test_skip_leaves_out_exactly_the_documents_no_plan_holds():
    loader = _loader(_dataset(), 3, "skip")
    view = loader.source.dataset
    over = [i for i, n in enumerate(LENGTHS) if n > 3 * CAP]
    assert view.oversize_ids.tolist() == over
    assert sorted(view.doc.tolist()) == [i for i in range(len(LENGTHS)) if i not in over]
    for ids, lens in _epoch(loader, 10):
        assert max(lens) <= loader.limit


def test_error_refuses_at_construction_naming_count_ids_and_lengths():
    with pytest.raises(OversizeError) as e:
        _loader(_dataset(), 3, "error")
    msg = str(e.value)
    assert "4 documents" in msg and "1 (400 tokens)" in msg and "6 (1000 tokens)" in msg and "111 tokens" in msg
    with pytest.raises(OversizeError, match="2 documents"):
        _loader(_dataset(), 9, "error")  # 9 x 37 = 333: still too short for 400 and 1000


def test_error_refuses_before_any_step_with_nothing_too_long_it_trains():
    loader = _loader(_dataset(), 28, "error")  # 28 x 37 = 1036: everything fits
    assert loader.source.dataset is loader.source.base
    assert len(_epoch(loader, 3)) == 3


@pytest.fixture
def store(tmp_path):
    with TokenStoreWriter(tmp_path / "data", np.uint16) as w:
        for i, n in enumerate(LENGTHS):
            w.add(_tokens(n, i).numpy())
    return tmp_path


@pytest.mark.parametrize("mode", ["split", "skip"])
def test_a_token_store_is_checked_from_its_index(store, mode):
    ts = TokenStore(store)
    loader = _loader(ts, 2, mode)
    assert loader.limit == 2 * CAP
    n_over = sum(n > 2 * CAP for n in LENGTHS)
    assert len(loader.source.dataset.oversize_ids) == n_over
    for ids, lens in _epoch(loader, 6):
        assert max(lens) <= 2 * CAP
    with pytest.raises(OversizeError, match=f"{n_over} documents of TokenStore"):
        _loader(ts, 2, "error")


# -- resume on another world size ---------------------------------------------------------------------

def _run(world, mode, steps, state=None, capacity=CAP):
    loader = _loader(_dataset(), world, mode, capacity=capacity)
    if state is not None:
        loader.load_state_dict(state)
    out = _epoch(loader, steps)
    return out, loader.state_dict()


@pytest.mark.parametrize("mode", ["split", "skip"])
@pytest.mark.parametrize("after,capacity", [(5, CAP), (2, 2 * CAP)])
def test_dataset_resume_on_another_world_size_sees_the_same_batches(mode, after, capacity):
    whole, _ = _run(3, mode, 9)
    first, state = _run(3, mode, 4)
    rest, _ = _run(after, mode, 5, state, capacity)
    assert first + rest == whole
    assert _run(after, mode, 9, None, capacity)[0] != whole  # the run's limit, not this mesh's, decides


def test_resume_on_a_mesh_too_small_for_the_runs_pieces_fails_before_the_first_step():
    _, state = _run(5, "split", 2)  # pieces of up to 185 tokens
    with pytest.raises(ValueError, match="capacity of at least 62 tokens per unit"):
        _run(3, "split", 1, state)


def test_error_mode_resume_on_a_smaller_mesh_names_the_documents():
    _, state = _run(28, "error", 2)
    with pytest.raises(OversizeError, match=r"6 \(1000 tokens\)"):
        _run(3, "error", 1, state, capacity=CAP)  # refused at construction, before the state loads
    again, _ = _run(5, "error", 1, state, capacity=200)  # 1000 tokens fit 5 x 200: the same next batch
    assert again == _run(28, "error", 3)[0][2:3]


# -- the data service: per drawn document ---------------------------------------------------------------

@pytest.fixture
def spec(store):
    return {"tokens_per_batch": BUDGET, "seed": 4, "sources": [{"name": "code", "store": str(store)}]}


def _service_run(spec, world, mode, steps, state=None, capacity=CAP):
    with DataService(spec, workers=1, prefetch=2) as svc:
        loader = HDPLoader(svc.client(), PlannerConfig(capacity),
                           LoaderConfig(BUDGET, oversize=mode, prefetch=False, check_plan=False),
                           rank=0, world_size=world)
        if state is not None:
            loader.load_state_dict(state)
        out, texts = [], []
        for _, step in zip(range(steps), loader):
            out.append((tuple(step.sample_ids), tuple(step.batch.lengths)))
            pieces = {}  # batch position -> (sample id, tokens, positions) of what this rank holds
            for mb in step.micro_batches:
                at = 0
                for doc, a, b in mb.plan.token_ranges():
                    ids, pos = mb.input_ids[at:at + b - a], mb.position_ids[at:at + b - a]
                    at += b - a
                    pieces.setdefault(doc.batch_pos, []).append((doc.sample_id, ids, pos))
            texts.append(pieces)
        state_after = loader.state_dict()
        loader.close()
        loader.source.close()
    return out, state_after, texts


@pytest.mark.timeout(240)
def test_service_split_cuts_each_drawn_document_into_consecutive_pieces(spec, caplog):
    caplog.set_level(logging.WARNING, "bytescale.data.oversize")
    out, _, _ = _service_run(spec, 3, "split", 14)
    limit = 3 * CAP
    long_drawn = set()
    for ids, lens in out:
        i = 0
        while i < len(ids):  # a long document: its pieces one after another, no token dropped
            n = LENGTHS[ids[i]]
            k = -(-n // limit)
            assert list(ids[i:i + k]) == [ids[i]] * k
            assert list(lens[i:i + k]) == [min(limit, n - j * limit) for j in range(k)]
            if k > 1:
                long_drawn.add(ids[i])
            i += k
    assert long_drawn, "the run was meant to draw a long document"
    logged = [r.getMessage() for r in caplog.records if "split into" in r.getMessage()]
    assert len(logged) == len(long_drawn)  # once per document, though epochs draw it again
    assert all("source 'code'" in m for m in logged)


@pytest.mark.timeout(240)
def test_service_pieces_read_the_documents_tokens(spec):
    """One unit of 111 tokens holds every piece: the pieces of a drawn document, in batch order,
    are its tokens (each piece's positions restart at 0: a document of its own)."""
    out, _, texts = _service_run(spec, 1, "split", 12, capacity=3 * CAP)
    long_seen = 0
    for (ids, lens), pieces in zip(out, texts):
        docs = {}
        for bp in sorted(pieces):
            (sid, tok, pos), = pieces[bp]
            assert pos.tolist() == list(range(lens[bp]))
            docs.setdefault(sid, []).append(tok)
        for sid, parts in docs.items():
            assert torch.equal(torch.cat(parts), _tokens(LENGTHS[sid], sid)), sid
            long_seen += len(parts) > 1
    assert long_seen, "the run was meant to draw a long document"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["skip", "error"])
def test_service_skip_and_error_leave_the_document_out_and_go_on(spec, mode, caplog):
    caplog.set_level(logging.WARNING, "bytescale.data.oversize")
    out, _, _ = _service_run(spec, 3, mode, 12)
    assert len(out) == 12
    for ids, lens in out:
        assert all(LENGTHS[i] <= 3 * CAP for i in ids)
        assert list(lens) == [LENGTHS[i] for i in ids]
    assert any("skipped" in r.getMessage() for r in caplog.records)
    if mode == "error":
        assert any(r.levelno == logging.ERROR for r in caplog.records)


@pytest.mark.timeout(240)
def test_service_error_refuses_a_spec_whose_bound_exceeds_the_mesh(spec):
    spec = {**spec, "sources": [{**spec["sources"][0], "max_length": 500}]}
    with DataService(spec, workers=1) as svc:
        client = svc.client()
        with pytest.raises(OversizeError, match="up to 500 tokens"):
            HDPLoader(client, PlannerConfig(CAP), LoaderConfig(BUDGET, oversize="error", prefetch=False,
                                                               check_plan=False), rank=0, world_size=3)
        client.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["split", "skip"])
def test_service_resume_on_another_world_size_sees_the_same_batches(spec, mode):
    whole, _, _ = _service_run(spec, 3, mode, 10)
    first, state, _ = _service_run(spec, 3, mode, 4)
    rest, _, _ = _service_run(spec, 5, mode, 6, state)
    assert first + rest == whole
    assert any(LENGTHS[i] > 3 * CAP for ids, _ in rest for i in (ids if mode == "split" else ())) or mode == "skip"
    assert _service_run(spec, 5, mode, 10)[0] != whole  # the run's limit, not this mesh's, decides


# -- the trainer: the same option, the same default, the library's view ------------------------------

@pytest.mark.parametrize("mode", ["split", "skip", "error"])
def test_trainer_builds_its_dataset_with_the_librarys_option(store, mode):
    from bytescale.train.build import build_dataset
    from bytescale.train.config import ConfigError, loader_config, parse_args

    args = ["--data", str(store), "--max-length", "111"] + (["--oversize", mode] if mode != "split" else [])
    cfg = parse_args(args)
    assert loader_config(cfg).oversize == mode == cfg.data.oversize  # split: the default of both
    assert LoaderConfig(1).oversize == "split"
    if mode == "error":
        with pytest.raises(ConfigError, match=r"4 documents of TokenStore .* 1 \(400 tokens\)"):
            build_dataset(cfg, 111)
        return
    ds, _, desc = build_dataset(cfg, 111)
    assert isinstance(ds, DocumentView) and ds.lengths.max() <= 111 and "4 longer" in desc
    want = sum(-(-n // 111) for n in LENGTHS) if mode == "split" else sum(n <= 111 for n in LENGTHS)
    assert len(ds) == want
