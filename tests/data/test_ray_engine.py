"""Data service, Ray engine: a real local Ray cluster (2 CPUs) started by the test.

Same batches as the local engine for the same spec, tokens from the actors that hold them, resume
across engines and client counts, and a killed source actor restarted with nothing lost.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed for this Python (pip install ray)")

from bytescale.data import DataService, MixingSpec, TokenStore  # noqa: E402
from bytescale.data.prepare import prepare  # noqa: E402

from corpus_utils import make_texts, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    # Workers import bytescale from this checkout, like the test process does.
    path = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    web = make_texts(80, seed=21, scale=30)
    lines = [json.dumps({"text": t}) for t in web]
    lines[3] = "not json"
    (d / "web.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(write_jsonl(d / "code.jsonl", make_texts(60, seed=22, scale=50)))], str(d / "code"),
            progress=False, plot=False)
    return MixingSpec.from_dict({"tokens_per_batch": 5000, "seed": 3, "sources": [
        {"name": "web", "text": [str(d / "web.jsonl")], "weight": 1.0, "workers": 2},
        {"name": "code", "store": str(d / "code"), "weight": 1.0}]}), web, TokenStore(d / "code")


def _truth(spec, sid):
    _, web, store = spec
    return np.frombuffer(web[sid].encode(), np.uint8) if sid < len(web) else store.array(sid - len(web))


def _read_all(spec, src, batch):
    for sid, n in zip(batch.sample_ids, batch.lengths):
        a, b = n // 4, n // 4 + n // 2
        assert src.tokens(sid, a, b).tolist() == _truth(spec, sid)[a:b].astype(np.int64).tolist()


def test_ray_engine_same_batches_resume_and_killed_actor(cluster, spec):
    """One Ray service (each actor is a process that imports bytescale: keep them few): two
    clients see the local engine's batches; a source actor killed mid-run is restarted with
    nothing lost; three clients resumed from a saved state see the batches that followed it."""
    with DataService(spec[0], prefetch=2) as local:
        c = local.client()
        ref = [c.next_batch() for _ in range(12)]
        c.close()
    with DataService(spec[0], engine="ray", prefetch=2) as svc:
        assert svc.address.startswith("ray:")
        clients = [svc.client() for _ in range(2)]  # two "ranks"
        got = []
        for k in range(8):
            if k == 3:
                ns = svc.address.split(":", 1)[1]
                ray.kill(ray.get_actor("src0-w1", namespace=ns), no_restart=False)
            bs = [c.next_batch() for c in clients]
            assert bs[0] == bs[1]
            _read_all(spec, clients[k % 2], bs[0])
            got.append(bs[0])
            if k == 4:
                state = json.loads(json.dumps(clients[1].state_dict()))
        for c in clients:
            c.close()
        assert got == ref[:8]
        resumed = [svc.client() for _ in range(3)]  # 2 -> 3 clients, from the state after step 4
        for c in resumed:
            c.load_state_dict(state)
        for k in range(5, 12):
            bs = [c.next_batch() for c in resumed]
            assert all(b == ref[k] for b in bs)
        _read_all(spec, resumed[2], bs[0])
        for c in resumed:
            c.close()


def test_ray_engine_reports_bad_inputs(cluster, tmp_path):
    with pytest.raises(RuntimeError, match="nope.jsonl: no such file"):
        DataService({"tokens_per_batch": 10, "sources": [{"name": "x", "text": [str(tmp_path / "nope.jsonl")]}]},
                    engine="ray")
