"""The synthetic corpora reproduce the paper's published statistics (in expectation)."""
from __future__ import annotations

import numpy as np
import pytest

from bytescale.data.synthetic import corpus_stats, global_batch_lengths, sample_lengths


def test_byted_statistics():
    s = corpus_stats(sample_lengths("byted", 2_000_000, seed=7))
    assert s["samples_le_4k"] == pytest.approx(0.80, abs=0.005)
    assert s["samples_ge_128k"] == pytest.approx(0.01, abs=0.001)
    assert s["tokens_ge_128k"] == pytest.approx(0.443, abs=0.02)
    assert s["samples_2m"] == pytest.approx(0.0005, abs=0.0001)
    assert s["tokens_2m"] == pytest.approx(0.121, abs=0.02)
    assert s["tokens_gt_256k"] == pytest.approx(0.37, abs=0.02)


def test_github_statistics():
    s = corpus_stats(sample_lengths("github", 2_000_000, seed=3))
    assert s["tokens_gt_128k"] == pytest.approx(0.162, abs=0.01)
    assert s["tokens_gt_256k"] == pytest.approx(0.098, abs=0.01)


def test_scale_and_batches():
    a = sample_lengths("byted", 1000, seed=1)
    b = sample_lengths("byted", 1000, seed=1, scale=1 / 256)
    assert (b >= 1).all() and b.max() <= 8192 and np.corrcoef(a, b)[0, 1] > 0.99
    g = global_batch_lengths("byted", 1 << 20, seed=2, scale=1 / 64)
    assert g.sum() <= 1 << 20 and g.sum() > (1 << 20) * 0.5
    with pytest.raises(ValueError, match="unknown corpus"):
        sample_lengths("wiki", 3)
