"""The ported script of README "Port your script" on a token store holding a document longer than
the world can hold (issue 41): 3 processes, real Gloo, the package's Llama. With the default
``oversize="split"`` it trains through the document (its pieces, every token) and ends with the
parameters of single-process float64 training on the same global batches; with ``"error"`` every
rank refuses at construction naming the document, before any step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bytescale import HybridDataParallel, LoaderConfig, PlannerConfig, StepExecutor, token_level_loss
from bytescale.attention import Layout
from bytescale.data import IGNORE_INDEX, DocumentView, HDPLoader, OversizeError, TokenStore, TokenStoreWriter
from bytescale.models import Llama, LlamaConfig
from dist_utils import run_distributed

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40)
LENGTHS = [31, 17, 250, 44, 9, 60, 23, 12, 5, 38]  # 250 > 3 ranks x 40 tokens
CAPACITY, BUDGET, STEPS, WORLD = 40, 160, 5, 3


def _write_store(path) -> None:
    with TokenStoreWriter(path / "data", np.uint8) as w:
        for i, n in enumerate(LENGTHS):
            w.add((np.arange(n) * 5 + i * 3) % CFG.vocab_size)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(CFG).double()


def _ported(rank: int, world: int, path: str, mode: str):
    try:
        loader = HDPLoader(TokenStore(path),                       # the README's three lines
                           PlannerConfig(capacity=CAPACITY),
                           LoaderConfig(tokens_per_batch=BUDGET, oversize=mode, max_steps=STEPS))
    except OversizeError as e:
        return "refused", str(e)
    model = HybridDataParallel(_model())
    executor = StepExecutor(model)  # the README loop's micro_batch / token_level_loss / finish_step
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = []
    for step in loader:
        executor.run(step)
        opt.step()
        opt.zero_grad()
        batches.append(list(step.sample_ids))
    loader.close()
    return "trained", batches, [p.detach() for p in model.module.parameters()]


def _reference(path, batches):
    """One process, whole pieces with plain causal attention, the same global batches."""
    view = DocumentView(TokenStore(path), WORLD * CAPACITY)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for ids in batches:
        docs = [view.tokens(i, 0, view.length(i)) for i in ids]
        labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        logits = model(torch.cat(docs), pos, layout=Layout.local([len(d) for d in docs]))
        token_level_loss(logits, labels, sum(len(d) - 1 for d in docs)).backward()
        opt.step()
        opt.zero_grad()
    return view, [p.detach() for p in model.parameters()]


@pytest.mark.timeout(300)
def test_ported_script_trains_through_a_document_longer_than_the_world(tmp_path):
    _write_store(tmp_path)
    out = run_distributed(_ported, WORLD, str(tmp_path), "split", timeout=240)
    assert all(o[0] == "trained" for o in out)
    batches = out[0][1]
    assert len(batches) == STEPS and all(o[1] == batches for o in out)
    view, ref = _reference(tmp_path, batches)
    pieces = set(np.flatnonzero(view.doc == 2).tolist())
    assert len(pieces) == 3 and pieces <= {i for ids in batches for i in ids}  # all of document 2 trained
    for o in out:
        for p, q in zip(o[2], ref):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)


@pytest.mark.timeout(300)
def test_ported_script_with_error_refuses_at_construction_naming_the_document(tmp_path):
    _write_store(tmp_path)
    out = run_distributed(_ported, WORLD, str(tmp_path), "error", timeout=240)
    for kind, msg in out:
        assert kind == "refused"
        assert "1 document of TokenStore is longer than the 120 tokens" in msg and "2 (250 tokens)" in msg
