"""Training on CUDA where CUDA's execution model differs from the CPU runs: autograd runs backward
on its device thread (grad hooks, activation-checkpoint recomputation). Skipped without a GPU.

Issue 21 finding 4: the micro-batch layout of an HF model (micro_batch_context, as
HybridDataParallel sets it) must reach the checkpoint's recompute on the device thread, or the
packed micro-batch is attended as ONE document (gradients 81% off, silently). CPU proof:
tests/runtime/test_hf.py (backward on a separate thread, bytescale.testing); this is the same
check with real CUDA autograd.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")


def _hf(checkpointing: bool):
    import bytescale.models.hf  # noqa: F401

    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "bytescale"
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).cuda()
    if checkpointing:
        if hasattr(m, "activation_checkpointing_enable"):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    return m


def test_checkpoint_recompute_on_the_cuda_device_thread_sees_the_layout():
    from bytescale.attention import Layout, micro_batch_context

    lens = [190, 70, 260]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (sum(lens),), generator=g).cuda()
    pos = torch.cat([torch.arange(n) for n in lens]).cuda()
    m = _hf(True)
    with micro_batch_context(Layout.local(lens)):
        logits = m(input_ids=ids[None], position_ids=pos[None]).logits[0]
        logits.float().square().mean().backward()  # CUDA autograd: the device thread
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    ref = _hf(False)
    total = sum(lens) * ref.config.vocab_size
    for d in ids.split(lens):
        (ref(input_ids=d[None]).logits[0].float().square().sum() / total).backward()
    for n, p in ref.named_parameters():
        err = ((got[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
        assert err < 1e-3, f"{n}: relative error {err:.2e}"
