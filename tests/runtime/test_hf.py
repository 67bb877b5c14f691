"""HF transformers LlamaForCausalLM with attn_implementation="bytescale" against HF's own eager
attention (one process): one document, and packed documents under a local layout.

HF's eager attention runs its softmax in float32 even for a float64 model, so agreement is to
~1e-6 (relative), not float64 precision."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bytescale.models.hf  # noqa: E402,F401  (registers the implementation)
from bytescale.attention import Layout, micro_batch_context  # noqa: E402


def _config(impl):
    cfg = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    cfg._attn_implementation = impl
    return cfg


def _models():
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(_config("bytescale")).double()
    b = transformers.LlamaForCausalLM(_config("eager")).double()
    b.load_state_dict(a.state_dict())
    return a, b


def test_single_document_matches_eager():
    a, b = _models()
    ids = torch.randint(0, 101, (1, 37))
    la = a(input_ids=ids).logits
    lb = b(input_ids=ids).logits
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    la.square().sum().backward()
    lb.square().sum().backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_packed_documents_match_eager_per_document():
    a, b = _models()
    lens = [11, 1, 23, 6]
    docs = [torch.randint(0, 101, (n,)) for n in lens]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with micro_batch_context(Layout.local(lens)):
        packed = a(input_ids=ids, position_ids=pos).logits[0]
    ref = torch.cat([b(input_ids=d[None]).logits[0] for d in docs])
    torch.testing.assert_close(packed, ref, rtol=1e-5, atol=1e-6)


def test_batched_input_is_rejected_clearly():
    a, _ = _models()
    with pytest.raises(ValueError, match="batch size 1"):
        a(input_ids=torch.randint(0, 101, (2, 5)))
