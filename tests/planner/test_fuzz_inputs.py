"""Fuzzing the planner's inputs with a bounded time (hypothesis, derandomized: the same examples on
every run, so CI is stable; each test a few seconds).

Every malformed input must give a clear error (ValueError naming the field or value), never a crash,
a hang or a silently wrong object: the plan deserialisers (``Plan.from_bytes``,
``MicroBatchPlan.from_bytes``: random bytes, truncations, bit flips of valid plans), the profile
JSON loader (``CostModel.from_json`` / ``load_cost_model``) and ``bytescale.plan`` itself. A plan
that does deserialise must be usable: its micro-batches, replay and lockstep slots either work or
raise a clear error.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bytescale
from bytescale.planner import CostModel, MicroBatchPlan, Plan, load_cost_model
from fuzz_utils import flip_bits

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

_VALID_LENGTHS = [5, 900, 33, 4000, 17, 250, 1200, 8]
_VALID = bytescale.plan(_VALID_LENGTHS, world_size=5, capacity=1024)
_VALID_BYTES = _VALID.to_bytes()
_MB = next(mb for r in range(5) for mb in _VALID.micro_batches(r) if mb.is_ring)
_MB_BYTES = _MB.to_bytes()


def _use(p: Plan) -> None:
    """Everything a loader does with a plan: it works or raises a clear error."""
    try:
        p.summary()
        for r in range(p.world_size):
            for mb in p.micro_batches(r):
                mb.num_tokens, mb.token_ranges()
        p.replay()
        p.lockstep()
    except (ValueError, IndexError) as e:
        assert str(e)


def _plan_from(data: bytes) -> None:
    try:
        p = Plan.from_bytes(data)
    except ValueError as e:
        assert str(e).startswith("plan"), str(e)
        return
    _use(p)


@FUZZ
@given(st.binary(max_size=512))
def test_plan_from_random_bytes(data):
    _plan_from(data)


@FUZZ
@given(st.binary(max_size=256))
def test_plan_from_valid_header_then_garbage(tail):
    _plan_from(_VALID_BYTES[:8] + tail)


def test_plan_from_every_truncation():
    for n in range(len(_VALID_BYTES)):
        with pytest.raises(ValueError, match="plan bytes"):
            Plan.from_bytes(_VALID_BYTES[:n])
    with pytest.raises(ValueError, match="trailing"):
        Plan.from_bytes(_VALID_BYTES + b"\0")


@FUZZ
@given(st.lists(st.integers(0, len(_VALID_BYTES) * 8 - 1), min_size=1, max_size=4))
def test_plan_with_bit_flips(bits):
    _plan_from(flip_bits(_VALID_BYTES, bits))


@FUZZ
@given(st.integers(8, len(_VALID_BYTES) - 8), st.integers(-2**63, 2**63 - 1))
def test_plan_with_a_corrupted_word(offset, value):
    data = bytearray(_VALID_BYTES)
    data[offset:offset + 8] = int(value).to_bytes(8, "little", signed=True)
    _plan_from(bytes(data))


def _mb_from(data: bytes) -> None:
    try:
        mb = MicroBatchPlan.from_bytes(data)
    except ValueError as e:
        assert "MicroBatchPlan" in str(e), str(e)
        return
    mb.num_tokens, mb.token_ranges(), mb.layout()


@FUZZ
@given(st.binary(max_size=300))
def test_micro_batch_plan_from_random_bytes(data):
    _mb_from(data)


def test_micro_batch_plan_from_every_truncation():
    for n in range(len(_MB_BYTES)):
        with pytest.raises(ValueError, match="MicroBatchPlan"):
            MicroBatchPlan.from_bytes(_MB_BYTES[:n])
    assert MicroBatchPlan.from_bytes(_MB_BYTES) == _MB


@FUZZ
@given(st.lists(st.integers(0, len(_MB_BYTES) * 8 - 1), min_size=1, max_size=3))
def test_micro_batch_plan_with_bit_flips(bits):
    _mb_from(flip_bits(_MB_BYTES, bits))


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
_MB_KEYS = ["rank", "index", "local", "sharded", "ring", "ring_pos", "ring_id", "offload_ratio",
            "predicted_time", "format"]


@FUZZ
@given(st.sampled_from(_MB_KEYS), _JSON_VALUES)
def test_micro_batch_plan_with_a_wrong_field(key, value):
    d = json.loads(_MB_BYTES)
    d[key] = value
    _mb_from(json.dumps(d).encode())


@FUZZ
@given(st.sampled_from(["batch_pos", "sample_id", "length"]), _JSON_VALUES)
def test_micro_batch_plan_with_a_wrong_document_field(key, value):
    d = json.loads(_MB_BYTES)
    d["sharded"][0][key] = value
    _mb_from(json.dumps(d).encode())


# ---- the profile JSON loader -----------------------------------------------------------------

_COST_KEYS = ["a1", "b1", "g", "a2", "b2", "layers", "bw_d2h", "bw_h2d", "ring_bw", "ring_latency",
              "kv_bytes_per_token"]


def _cost_from(text: str) -> None:
    try:
        m = CostModel.from_json(text)
    except ValueError as e:
        assert "cost model" in str(e), str(e)
        return
    for k in _COST_KEYS:  # a model that loads is a valid one: finite, non-negative
        v = getattr(m, k)
        assert math.isfinite(v) and v >= 0, (k, v, text)
    try:  # huge coefficients are valid numbers but may overflow a micro-batch's cost
        bytescale.plan([100, 3000], world_size=2, capacity=2048, cost=m)
    except ValueError as e:
        assert "the cost model gives micro-batch" in str(e), str(e)


@FUZZ
@given(st.text(max_size=200))
def test_cost_model_from_random_text(text):
    _cost_from(text)


@FUZZ
@given(st.dictionaries(st.sampled_from(_COST_KEYS + ["extra"]), _JSON_VALUES, max_size=6))
def test_cost_model_from_wrong_types_and_values(d):
    _cost_from(json.dumps(d))  # NaN / Infinity written as JSON's extensions


@FUZZ
@given(st.sampled_from(_COST_KEYS), st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0,
                                                     -1e-300, 0.0, 1e308, 1e-320]))
def test_cost_model_special_numbers(key, value):
    d = json.loads(CostModel().to_json())
    d[key] = value
    _cost_from(json.dumps(d))
    try:
        load_cost_model(d)
    except ValueError as e:
        assert key in str(e) or "cost model" in str(e), str(e)


@FUZZ
@given(st.integers(0, len(CostModel().to_json()) - 1))
def test_cost_model_truncated(n):
    text = CostModel().to_json()[:n]
    with pytest.raises(ValueError, match="cost model"):
        CostModel.from_json(text)


def test_cost_model_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text("{\"a1\": ")
    with pytest.raises(ValueError, match="profile.json"):
        load_cost_model(bad)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_cost_model(tmp_path / "missing.json")


# ---- the planner's inputs --------------------------------------------------------------------

_LENGTH = (st.integers(-5, 1 << 42) | st.floats(allow_nan=True, allow_infinity=True)
           | st.booleans() | st.text(max_size=3) | st.none())


@FUZZ
@given(st.lists(_LENGTH, max_size=12), st.integers(-2, 9) | st.floats() | st.none(),
       st.integers(-3, 1 << 16) | st.floats(),
       st.sampled_from(["balanced", "naive", "pow2", "bogus"]), st.booleans())
def test_plan_inputs(lengths, world, capacity, strategy, offload):
    try:
        p = bytescale.plan(lengths, world_size=world, capacity=capacity, strategy=strategy,
                           offload=offload, verify=True)
    except ValueError as e:
        assert str(e)
        return
    assert int(p.lengths.sum()) == sum(int(x) for x in lengths)
    _use(p)


@FUZZ
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=16), st.integers(1, 9),
       st.integers(1, 4096), st.dictionaries(st.sampled_from(_COST_KEYS), st.floats(0, 1e3), max_size=3),
       st.none() | st.lists(st.floats(-1, 4) | st.just(float("nan")), max_size=10),
       st.none() | st.lists(st.floats(-1, 4) | st.just(float("nan")), max_size=10))
def test_plan_with_costs_speeds_and_memory(lengths, world, capacity, cost, speed, memory):
    try:
        p = bytescale.plan(lengths, world_size=world, capacity=capacity, cost=cost, speed=speed,
                           memory=memory, verify=True)
    except ValueError as e:
        assert str(e)
        return
    assert np.array_equal(p.lengths, np.asarray(lengths))
    _use(p)


def test_cost_model_coefficient_of_the_wrong_type_is_named():
    for value in ("1e-9", None, True):
        with pytest.raises(ValueError, match="a1 must be a number"):
            load_cost_model({"a1": value})
    with pytest.raises(ValueError, match="not JSON numbers"):
        load_cost_model({"a1": {1, 2}})
    # missing coefficients keep their defaults; unknown keys (a profile's metadata) are ignored
    m = load_cost_model({"a1": 2e-9, "device": "cpu"})
    assert m.a1 == 2e-9 and m.b1 == CostModel().b1


def test_plan_bytes_with_a_huge_sequence_count_fail_fast():
    data = bytearray(_VALID_BYTES)
    data[12:20] = (1 << 40).to_bytes(8, "little")  # num_sequences (after magic, version, world)
    with pytest.raises(ValueError, match="num_sequences"):
        Plan.from_bytes(bytes(data))
