"""HF transformers LlamaForCausalLM with attn_implementation="bytescale" against HF's own eager
attention (one process): one document, and packed documents under a local layout.

HF's eager attention runs its softmax in float32 even for a float64 model, so agreement is to
~1e-6 (relative), not float64 precision."""
from __future__ import annotations

import contextlib

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


def _checkpointed_grads(on_device_thread: bool):
    """A tiny HF Llama with non-reentrant activation checkpointing on one packed micro-batch of
    three documents (layout from micro_batch_context, as HybridDataParallel sets it), backward
    either on this thread or on a separate one (CUDA autograd's device thread, where the
    checkpoint's recompute runs)."""
    from bytescale.testing import backward_on_device_thread

    a, _ = _models()
    if hasattr(a, "activation_checkpointing_enable"):  # transformers >= 5.x
        a.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        a.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    a.train()
    lens = [19, 7, 26]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    block = backward_on_device_thread() if on_device_thread else contextlib.nullcontext()
    with micro_batch_context(Layout.local(lens)):
        logits = a(input_ids=ids[None], position_ids=pos[None]).logits[0]
        with block:
            logits.square().mean().backward()
    return {n: p.grad.clone() for n, p in a.named_parameters()}, ids, lens


def _per_document_grads(ids, lens):
    """The reference: the same model without checkpointing, each document on its own (sum of
    per-document contributions to the same mean)."""
    a, _ = _models()
    total = sum(lens) * a.config.vocab_size
    for d in ids.split(lens):
        logits = a(input_ids=d[None]).logits[0]
        (logits.square().sum() / total).backward()
    return {n: p.grad.clone() for n, p in a.named_parameters()}


@pytest.mark.parametrize("on_device_thread", [False, True], ids=["same-thread", "device-thread"])
def test_checkpoint_recompute_sees_the_micro_batch_layout(on_device_thread):
    """Issue 21 finding 4: the recompute of activation checkpointing runs on autograd's device
    thread on CUDA; the micro-batch layout must reach it there too, or the packed micro-batch is
    attended as ONE document and the gradients are silently wrong."""
    got, ids, lens = _checkpointed_grads(on_device_thread)
    want = _per_document_grads(ids, lens)
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-8, msg=lambda m: f"{n}: {m}")
