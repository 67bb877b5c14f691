"""Data service, local engine: real worker processes and client processes ("ranks").

The reference for every batch is the sampler driven by lengths computed here, directly from the raw
text (UTF-8 bytes) and the token store: independent of the service's workers, chunks and sockets.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import numpy as np
import pytest

from bytescale.data import DataService, MixingSampler, MixingSpec, TokenStore, connect
from bytescale.data.prepare import prepare

from corpus_utils import make_texts, run_forked, write_jsonl

BUDGET = 6000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("svc")
    web = make_texts(150, seed=11, scale=30)
    lines = [json.dumps({"text": t}) for t in web]
    lines[7] = "{broken json"
    lines[20] = json.dumps({"title": "no text"})
    (d / "web.jsonl").write_text("\n".join(lines) + "\n")
    code = make_texts(120, seed=12, scale=50)
    prepare([str(write_jsonl(d / "code.jsonl", code))], str(d / "code"), progress=False, plot=False)
    spec = MixingSpec.from_dict({"tokens_per_batch": BUDGET, "seed": 5, "sources": [
        {"name": "web", "text": [str(d / "web.jsonl")], "weight": 2.0, "max_length": 5000},
        {"name": "code", "store": str(d / "code"), "weight": 1.0}]})
    web_tokens = [None if i in (7, 20) else np.frombuffer(t.encode(), np.uint8) for i, t in enumerate(web)]
    return spec, web_tokens, TokenStore(d / "code")


def _truth(corpus, sid):
    spec, web, store = corpus
    if sid < len(web):
        return web[sid]
    return store.array(sid - len(web))


def _reference(corpus, steps):
    spec, web, store = corpus
    lens = [np.array([-1 if t is None else len(t) for t in web]), store.lengths]
    smp = MixingSampler(spec, [len(web), len(store)])
    return [smp.next_batch(lambda s, p, i: int(lens[s][i])) for _ in range(steps)]


def _check_tokens(corpus, src, batch, rank=0, world=1):
    """Read this rank's share (documents i % world == rank: a half of each, plus one label token)."""
    for i, (sid, n) in enumerate(zip(batch.sample_ids, batch.lengths)):
        if i % world != rank:
            continue
        a, b = n // 3, min(n, n // 3 + n // 2 + 1)
        got = src.tokens(sid, a, b).numpy()
        assert got.tolist() == _truth(corpus, sid)[a:b].astype(np.int64).tolist(), (batch.step, sid)


def _rank(address, steps, rank, world, state=None, corpus=None):
    src = connect(address, timeout=60)
    if state is not None:
        src.load_state_dict(state)
    out = []
    for _ in range(steps):
        b = src.next_batch()
        _check_tokens(corpus, src, b, rank, world)
        out.append(b)
    st = src.state_dict()
    src.close()
    return out, st


def test_batches_match_the_reference_for_any_worker_count(corpus):
    ref = _reference(corpus, 12)
    for workers in (1, 3):
        with DataService(corpus[0], workers=workers, prefetch=2) as svc:
            src = svc.client()
            got = [src.next_batch() for _ in range(12)]
            assert got == ref, f"workers={workers}"
            for b in got[-3:]:
                _check_tokens(corpus, src, b)
            src.close()
    assert any(0 in b.sources for b in ref) and any(1 in b.sources for b in ref)


def test_ranks_in_separate_processes_see_identical_batches(corpus):
    ref = _reference(corpus, 8)
    with DataService(corpus[0], workers=2, prefetch=3) as svc:
        world = 3
        res = run_forked([_rank] * world, [(svc.address, 8, r, world, None, corpus) for r in range(world)], timeout=90)
    for batches, _ in res:
        assert batches == ref


@pytest.mark.parametrize("before,after", [(4, 3), (2, 5)])
def test_resume_at_another_number_of_clients(corpus, before, after):
    k1, k2 = 5, 6
    ref = _reference(corpus, k1 + k2)
    with DataService(corpus[0], workers=2, prefetch=2) as svc:
        res = run_forked([_rank] * before, [(svc.address, k1, r, before, None, corpus) for r in range(before)], timeout=90)
    states = [st for _, st in res]
    assert all(st == states[0] for st in states) and all(b == ref[:k1] for b, _ in res)
    state = json.loads(json.dumps(states[0]))  # a checkpoint goes through serialization
    with DataService(corpus[0], workers=3, prefetch=2) as svc:  # another worker count too
        res = run_forked([_rank] * after, [(svc.address, k2, r, after, state, corpus) for r in range(after)], timeout=90)
    for batches, _ in res:
        assert batches == ref[k1:]
    seen = [sid for b in ref for sid in b.sample_ids]
    assert [sid for b in ref[:k1] + res[0][0] for sid in b.sample_ids] == seen  # nothing lost or repeated
    with DataService(corpus[0], state=state) as svc:  # resuming through the service's constructor
        src = svc.client()
        assert src.next_batch() == ref[k1]
        src.close()


def test_killed_worker_is_replaced_and_nothing_is_lost(corpus, capfd):
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("bytescale.data.service").addHandler(handler)
    try:
        ref = _reference(corpus, 16)
        with DataService(corpus[0], workers=2, prefetch=1, standby=1) as svc:
            src = svc.client()
            got = [src.next_batch() for _ in range(4)]
            pids = svc.worker_pids()
            victim = pids["workers"][(0, 1)]
            os.kill(victim, signal.SIGKILL)
            for _ in range(12):
                b = src.next_batch()
                _check_tokens(corpus, src, b)
                got.append(b)
            after = svc.worker_pids()
            src.close()
        assert got == ref
        assert after["workers"][(0, 1)] in pids["standby"] and victim not in after["workers"].values()
        assert len(after["standby"]) == 1
        err = capfd.readouterr().err
        assert f"(pid {victim}) died" in err and "took over" in err
    finally:
        logging.getLogger("bytescale.data.service").removeHandler(handler)


def test_malformed_records_are_skipped_with_one_line_each(tmp_path, capfd):
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("bytescale.data.service").addHandler(handler)
    p = tmp_path / "m.jsonl"
    p.write_bytes(b'{"text": "good one"}\n{oops\n\n{"text": ""}\n{"text": "caf\xe9"}\n{"t": 1}\n'
                  b'{"text": "' + b"z" * 300 + b'"}\n{"text": "good two"}\n')
    try:
        spec = {"tokens_per_batch": 16, "sources": [{"name": "m", "text": [str(p)], "max_length": 100}]}
        with DataService(spec, workers=2) as svc:
            src = svc.client()
            b = src.next_batch()
            docs = sorted(bytes(src.tokens(i, 0, n).numpy().astype(np.uint8)) for i, n in zip(b.sample_ids, b.lengths))
            src.close()
        assert docs == [b"good one", b"good two"]  # the 300-byte one is over the source's max_length
        err = capfd.readouterr().err
        for line, why in [(2, "not JSON"), (4, "empty document"), (5, "bad UTF-8"), (6, "missing text field 'text'")]:
            assert sum(f"m.jsonl:{line}: {why}" in x for x in err.splitlines()) == 1, (line, err)
    finally:
        logging.getLogger("bytescale.data.service").removeHandler(handler)


def test_bad_inputs_fail_at_start_and_bad_states_are_refused(corpus, tmp_path):
    spec = corpus[0]
    with pytest.raises(RuntimeError, match="nope.jsonl: no such file"):
        DataService({"tokens_per_batch": 100, "sources": [{"name": "x", "text": [str(tmp_path / "nope.jsonl")]}]})
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(RuntimeError, match="tokenizer .*no such file"):
        DataService({"tokens_per_batch": 100, "sources": [{"name": "x", "text": [str(tmp_path / "a.jsonl")],
                                                            "tokenizer": str(tmp_path / "tok.json")}]})
    with pytest.raises(ValueError, match="tokens_per_batch must be given"):
        DataService({"sources": [{"name": "x", "text": [str(tmp_path / "a.jsonl")]}]})
    with DataService(spec, seed=99) as svc:
        src = svc.client()
        other = {"kind": "service", "fingerprint": "0" * 16, "sampler": {"step": 0, "positions": [0, 0], "drawn": [0, 0]}}
        with pytest.raises(ValueError, match="another spec, data, seed or token budget"):
            src.load_state_dict(other)
        with pytest.raises(IndexError, match="out of range"):
            src.tokens(10**9, 0, 1)
        b = src.next_batch()
        for sid, n in zip(b.sample_ids, b.lengths):  # both kinds of source
            with pytest.raises(IndexError, match="outside document"):
                src.tokens(sid, 0, n + 5)
        src.close()


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_service_exits_when_its_owner_dies(corpus):
    r, w = os.pipe()
    owner = os.fork()
    if owner == 0:  # the owner starts a service and dies without closing it
        try:
            svc = DataService(corpus[0], workers=1)
            os.write(w, json.dumps([svc.worker_pids()["workers"][(0, 0)], svc._proc.pid]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        pids = json.loads(f.read() or "[]")
    os.waitpid(owner, 0)
    assert len(pids) == 2, "the owner did not start the service"
    deadline = time.time() + 20
    while time.time() < deadline and not all(_dead(p) for p in pids):
        time.sleep(0.05)
    assert all(_dead(p) for p in pids), f"processes {pids} outlived the process that owned the service"
