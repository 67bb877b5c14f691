"""One step's data along its one path: sampler -> plan -> micro-batch plan -> layout -> attention
op -> transport. A loader built with default arguments gives, on every rank, per-document attention
equal to float64 attention on the full documents, for a batch that mixes local and sharded
documents (real processes, the bytescale backend, ring attention on dynamic groups)."""
from __future__ import annotations

import pytest
import torch

from bytescale.attention import attention, reference_varlen_attention
from bytescale.config import LoaderConfig, PlannerConfig
from bytescale.data import HDPLoader, SyntheticTokens
from dist_utils import run_distributed

LENGTHS = [211, 97, 13, 7, 45, 3, 130, 31, 64, 9, 150, 22, 5, 77, 1, 40]
H, HKV, D = 4, 2, 16


def _qkv(sample_id: int, length: int):
    g = torch.Generator().manual_seed(1000 + sample_id)
    return tuple(torch.randn(length, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV))


def _check_rank(rank, world):
    ds = SyntheticTokens(LENGTHS, vocab_size=50, seed=1)
    loader = HDPLoader(ds, PlannerConfig(capacity=90), LoaderConfig(tokens_per_batch=600, max_steps=2))
    rings = 0
    for step in loader:
        for mb in step.micro_batches:
            rows = {"q": [], "k": [], "v": [], "ref": []}
            for doc, a, b in mb.plan.token_ranges():
                if b <= a:
                    continue
                q, k, v = _qkv(doc.sample_id, doc.length)
                ref = reference_varlen_attention(q, k, v, [doc.length])
                for name, t in (("q", q), ("k", k), ("v", v), ("ref", ref)):
                    rows[name].append(t[a:b])
            if not rows["q"]:
                continue
            q, k, v, ref = (torch.cat(rows[n]) for n in ("q", "k", "v", "ref"))
            out = attention(q, k, v, layout=mb.layout)
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
            rings += mb.plan.is_ring
    loader.close()
    return rings


@pytest.mark.parametrize("world", [3])
def test_default_loader_attention_matches_full_documents(world):
    rings = run_distributed(_check_rank, world, timeout=240)
    assert sum(rings) >= 2, "the plan sharded nothing: the test would not exercise rings"
