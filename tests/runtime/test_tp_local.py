"""The local tensor-parallel plan (``tensor_parallel(..., compute="local")``, the default): the
layers compute on plain tensors with the TP collectives of ``bytescale.models.tp_ops``, and the
LM head's vocabulary-parallel logits are reduced by ``token_level_loss`` without gathering them.

Against independent references, float64, TP 3 (rows and vocabulary split unevenly):
- the row collectives (all-gather / reduce-scatter / slice of uneven ``Shard(0)`` rows, every
  token count from 0 to past the TP degree) forward and backward against the whole tensors;
- the vocabulary-parallel cross-entropy (37 words over 3 ranks, ignored labels, targets on every
  rank) against ``F.cross_entropy`` on the whole logits, loss and gradient;
- the whole model, dense with sharded and with shared KV heads, MoE, with and without sequence
  parallelism: losses and every parameter's gradient equal the unsharded model's on micro-batches
  of lengths divisible by nothing, and equal torch's DTensor styles (``compute="dtensor"``).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bytescale.models import LlamaConfig
from dist_utils import run_distributed
from fixtures import tiny_llama

pytestmark = pytest.mark.multiprocess

TP = 3


def _rows(tokens: int, index: int) -> slice:
    per = -(-tokens // TP) if tokens else 0
    lo = min(tokens, per * index)
    return slice(lo, min(tokens, lo + per))


def _collectives_worker(rank, world):
    import torch.distributed as dist

    from bytescale.models.tp_ops import gather_rows, scatter_rows, slice_rows
    from bytescale.runtime.loss import IGNORE_INDEX, token_level_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    group = dist.group.WORLD
    checked = 0
    for tokens in (0, 1, 2, 4, 5, 7):
        g = torch.Generator().manual_seed(tokens)
        whole = torch.randn(tokens, 3, generator=g, dtype=torch.float64)
        ups = [torch.randn(tokens, 3, generator=g, dtype=torch.float64) for _ in range(TP)]  # per rank
        mine = _rows(tokens, rank)
        for partial in (True, False):
            x = whole[mine].clone().requires_grad_(True)
            y = gather_rows(x, tokens, group, TP, rank, partial)
            assert torch.equal(y, whole), (tokens, partial)
            y.backward(ups[rank])
            want = sum(ups)[mine] if partial else ups[rank][mine]
            torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-12)
        parts = [torch.randn(tokens, 3, generator=g, dtype=torch.float64) for _ in range(TP)]
        x = parts[rank].clone().requires_grad_(True)
        y = scatter_rows(x, group, TP, rank)
        torch.testing.assert_close(y, sum(parts)[mine], rtol=1e-12, atol=1e-12)
        up = ups[0][mine]  # the rows' gradients, each rank its own: the whole gradient comes back
        y.backward(up)
        torch.testing.assert_close(x.grad, ups[0], rtol=0, atol=0)
        x = whole.clone().requires_grad_(True)
        y = slice_rows(x, group, TP, rank)
        assert torch.equal(y, whole[mine])
        y.backward(ups[0][mine])
        torch.testing.assert_close(x.grad, ups[0], rtol=0, atol=0)
        checked += 1
    # the vocabulary-parallel loss: 37 words over 3 ranks (13, 13, 11)
    mesh = init_device_mesh("cpu", (TP,))
    g = torch.Generator().manual_seed(7)
    V, T = 37, 11
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 3
    labels = torch.tensor([0, 12, 13, 36, IGNORE_INDEX, 25, 26, 5, IGNORE_INDEX, 30, 18])
    ref = logits.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(ref, labels, ignore_index=IGNORE_INDEX, reduction="sum") / 17
    ref_loss.backward()
    cols = slice(13 * rank, min(V, 13 * (rank + 1)))
    local = logits[:, cols].clone().requires_grad_(True)
    d = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False, shape=(T, V), stride=(V, 1))
    loss = token_level_loss(d, labels, 17)
    assert not isinstance(loss, DTensor)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    loss.backward()
    torch.testing.assert_close(local.grad, ref.grad[:, cols], rtol=1e-12, atol=1e-14)
    return checked


def test_row_collectives_and_the_vocabulary_parallel_loss_match_whole_tensors():
    assert run_distributed(_collectives_worker, TP) == [6] * TP


DENSE = LlamaConfig(vocab_size=37, dim=24, n_layers=2, n_heads=6, n_kv_heads=3, ffn_dim=30)
SHARED_KV = dataclasses.replace(DENSE, n_kv_heads=1)
MOE = dataclasses.replace(DENSE, ffn_dim=18, n_experts=3, top_k=2)
LENGTHS = ((7, 4), (1,), (11, 2, 1))  # micro-batches of packed documents


def _grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
            for n, p in model.named_parameters() if p.grad is not None}


def _run(model, cfg, lens, loss_tokens):
    from bytescale.attention.layout import Layout
    from bytescale.runtime.loss import token_level_loss

    g = torch.Generator().manual_seed(sum(lens))
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
    labels = torch.roll(ids, -1)
    pos = torch.cat([torch.arange(n) for n in lens])
    logits, aux = model(ids, pos, layout=Layout.local(list(lens)), global_tokens=loss_tokens, return_aux=True)
    loss = token_level_loss(logits, labels, loss_tokens) + aux
    loss.backward()
    return loss.detach()


def _plans_worker(rank, world, plans):
    import bytescale
    from bytescale.models.parallel import tensor_parallel

    mesh = bytescale.init_mesh(tp=TP)
    out = {}
    for name, cfg, sp in (("dense", DENSE, False), ("dense-sp", DENSE, True), ("shared-kv-sp", SHARED_KV, True),
                          ("shared-kv", SHARED_KV, False), ("moe-sp", MOE, True)):
        loss_tokens = sum(map(sum, LENGTHS))
        ref = tiny_llama(cfg)
        ref_losses = [_run(ref, cfg, lens, loss_tokens) for lens in LENGTHS]
        for compute in plans:
            tp_model = tensor_parallel(tiny_llama(cfg), mesh["tp"], sequence_parallel=sp, compute=compute)
            with pytest.raises(RuntimeError, match="already tensor-parallel"):
                tensor_parallel(tp_model, mesh["tp"], sequence_parallel=sp, compute=compute)
            losses = [_run(tp_model, cfg, lens, loss_tokens) for lens in LENGTHS]
            for a, b in zip(losses, ref_losses):
                torch.testing.assert_close(a if not hasattr(a, "full_tensor") else a.full_tensor(), b,
                                           rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} {compute}: {m}")
            got, want = _grads(tp_model), _grads(ref)
            assert got.keys() == want.keys(), (name, compute)
            for n in want:
                torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11,
                                           msg=lambda m: f"{name} {compute} {n}: {m}")
            out[(name, compute)] = len(got)
    return out


def test_local_plan_equals_the_unsharded_model_and_torchs_styles(cuda_execution_model):
    """Five configurations x two plans, each against the float64 unsharded model (TP 3: the
    vocabulary, the rows of 7-, 1- and 11-token micro-batches and the MoE's experts split
    unevenly). Under CUDA's execution model the local plan only (torch's styles are the
    reference; bytescale's collectives in backward are what that model exercises)."""
    plans = ("local",) if cuda_execution_model else ("local", "dtensor")
    outs = run_distributed(_plans_worker, TP, plans)
    assert all(o == outs[0] for o in outs) and len(outs[0]) == 5 * len(plans), outs[0]
