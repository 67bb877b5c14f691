"""Mixing spec and sampler: parsing, weights, filters, curriculum, determinism; DatasetSource."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bytescale.data import (CurriculumStage, DatasetSource, GlobalBatchSampler, InMemoryTokens, MixingSampler, MixingSpec,
                            SourceSpec)


def _spec(**kw):
    srcs = kw.pop("sources", (SourceSpec("a", store="/x/a", weight=3.0), SourceSpec("b", store="/x/b", weight=1.0)))
    return MixingSpec(tuple(srcs), **kw)


def test_dataset_source_matches_global_batch_sampler_and_resumes():
    lengths = [3 + (i * 37) % 50 for i in range(41)]
    ds = InMemoryTokens([torch.arange(n) + i for i, n in enumerate(lengths)])
    src = DatasetSource(ds, tokens_per_batch=120, seed=7)
    ref = GlobalBatchSampler(lengths, 120, seed=7)
    batches = []
    for k in range(30):  # several epochs
        b = src.next_batch()
        ids = ref.next_batch()
        assert b.step == k and list(b.sample_ids) == ids and list(b.lengths) == [lengths[i] for i in ids]
        assert b.sources == (0,) * len(ids)
        batches.append(b)
        if k == 11:
            state = src.state_dict()
    assert src.tokens(5, 1, 4).tolist() == [6, 7, 8]
    again = DatasetSource(ds, tokens_per_batch=120, seed=7)
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(18)] == batches[12:]


def test_spec_from_dict_json_and_toml_agree(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl").write_text("{}\n")
    d = {"tokens_per_batch": 4096, "seed": 3,
         "sources": [{"name": "code", "store": "store", "weight": 0.7, "max_length": 2048},
                     {"name": "web", "text": ["*.jsonl"], "weight": 0.3, "workers": 2}],
         "curriculum": [{"until_step": 10, "max_length": 512}, {"max_length": 1024}]}
    (tmp_path / "mix.json").write_text(json.dumps(d))
    (tmp_path / "mix.toml").write_text(
        'tokens_per_batch = 4096\nseed = 3\n[[sources]]\nname = "code"\nstore = "store"\nweight = 0.7\nmax_length = 2048\n'
        '[[sources]]\nname = "web"\ntext = ["*.jsonl"]\nweight = 0.3\nworkers = 2\n'
        '[[curriculum]]\nuntil_step = 10\nmax_length = 512\n[[curriculum]]\nmax_length = 1024\n')
    a = MixingSpec.from_dict(d, tmp_path)
    assert MixingSpec.load(tmp_path / "mix.json") == a == MixingSpec.load(tmp_path / "mix.toml")
    assert a.sources[0].store == str(tmp_path / "store")
    assert a.sources[1].text == (str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    assert [a.cap(k) for k in (0, 9, 10, 10**6)] == [512, 512, 1024, 1024]
    assert MixingSpec.from_dict(a.to_dict()) == a


@pytest.mark.parametrize("bad,match", [
    ({"sources": []}, "no source"),
    ({"sources": [{"name": "a"}]}, "exactly one of"),
    ({"sources": [{"name": "a", "store": "s", "text": ["t"]}]}, "exactly one of"),
    ({"sources": [{"name": "a", "store": "s", "weight": 0}]}, "weight must be positive"),
    ({"sources": [{"name": "a", "store": "s", "min_length": 10, "max_length": 5}]}, "bad length filter"),
    ({"sources": [{"name": "a", "store": "s", "colour": 1}]}, "unknown keys"),
    ({"sources": [{"name": "a", "store": "s"}], "batch": 1}, "unknown keys"),
    ({"sources": [{"name": "a", "text": ["/no/such/*.jsonl"]}]}, "no file matches"),
    ({"sources": [{"name": "a", "store": "s"}, {"name": "a", "store": "t"}]}, "duplicate"),
    ({"sources": [{"name": "a", "store": "s"}], "curriculum": [{"max_length": 5}, {"until_step": 3, "max_length": 9}]},
     "only the last"),
])
def test_bad_specs_are_rejected_clearly(bad, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        MixingSpec.from_dict(bad)


def _reference_single(lengths, budget, seed, steps):
    """The documented rule, written out for one source: walk the per-epoch permutations, fill to
    the budget, the document that does not fit opens the next batch."""
    n = len(lengths)
    stream = np.concatenate([np.random.default_rng([seed, 0, e]).permutation(n) for e in range(steps)])
    out, k = [], 0
    for _ in range(steps):
        b = [int(stream[k])]
        k += 1
        while sum(lengths[i] for i in b) + lengths[stream[k]] <= budget:
            b.append(int(stream[k]))
            k += 1
        out.append(b)
    return out


def test_single_source_follows_the_documented_rule_and_covers_each_epoch():
    lengths = np.array([5 + (i * 53) % 97 for i in range(50)])
    spec = MixingSpec((SourceSpec("s", store="/x"),), 300, seed=4)
    smp = MixingSampler(spec, [50])
    got = [list(smp.next_batch(lambda s, p, i: int(lengths[i])).sample_ids) for _ in range(40)]
    assert got == _reference_single(lengths, 300, 4, 40)
    flat = [i for b in got for i in b]
    assert sorted(flat[:50]) == list(range(50)) and sorted(flat[50:100]) == list(range(50))


def test_weights_filters_curriculum_and_determinism():
    rng = np.random.default_rng(0)
    la = rng.integers(1, 400, 300)
    lb = rng.integers(1, 400, 200)
    lens = [la, lb]
    spec = MixingSpec((SourceSpec("a", store="/a", weight=3.0, max_length=300), SourceSpec("b", store="/b", min_length=20)),
                      2000, seed=1)
    f = lambda s, p, i: int(lens[s][i])  # noqa: E731
    smp = MixingSampler(spec, [300, 200])
    batches = [smp.next_batch(f) for _ in range(200)]
    tok = np.zeros(2)
    for b in batches:
        assert b.num_tokens <= 2000
        for sid, n, s in zip(b.sample_ids, b.lengths, b.sources):
            s2, lid = smp.split(sid)
            assert s2 == s and n == lens[s][lid] and spec.sources[s].accepts(n)
            tok[s] += n
    assert abs(tok[0] / tok.sum() - 0.75) < 0.01, tok / tok.sum()
    again = MixingSampler(spec, [300, 200])
    assert [again.next_batch(f) for _ in range(200)] == batches
    other = MixingSampler(MixingSpec(spec.sources, 2000, seed=2), [300, 200])
    assert [other.next_batch(f) for _ in range(5)] != batches[:5]
    # curriculum: lengths cut until step 3, then free
    cur = MixingSpec(spec.sources, 2000, seed=1, curriculum=(CurriculumStage(3, 50),))
    c = MixingSampler(cur, [300, 200])
    cb = [c.next_batch(f) for _ in range(5)]
    assert all(max(b.lengths) <= 50 for b in cb[:3]) and max(max(b.lengths) for b in cb[3:]) > 50
    # resume from a state: same continuation
    smp2 = MixingSampler(spec, [300, 200])
    for _ in range(77):
        smp2.next_batch(f)
    st = smp2.state_dict()
    smp3 = MixingSampler(spec, [300, 200])
    smp3.load_state_dict(st)
    assert [smp3.next_batch(f) for _ in range(10)] == batches[77:87]


def test_a_source_with_nothing_passing_its_filter_fails_clearly():
    spec = MixingSpec((SourceSpec("a", store="/a", min_length=1000),), 5000)
    with pytest.raises(RuntimeError, match="no document in a whole epoch passes"):
        MixingSampler(spec, [10]).next_batch(lambda s, p, i: 5)
