"""HF transformers models as users write them, and under multi-rank HDP.

What works on transformers 5.x (and what the README documents): ``attn_implementation="bytescale"``
on ``AutoModelForCausalLM.from_config`` / ``from_pretrained``, on the config
(``LlamaConfig(..., attn_implementation="bytescale")``), and ``model.set_attn_implementation``;
``LlamaForCausalLM(config, attn_implementation=...)`` is not an HF API (TypeError).

Multi-rank: Llama, Qwen2 and Mixtral (HF classes, float64) trained with HDP at 4 ranks on batches
whose plans shard documents over rings of 2, 3 and 4 ranks give the gradients of single-process
training on the same global batches. HF's RMSNorm computes in float32 even for a float64 model,
so agreement is to ~1e-6, not float64 precision.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bytescale.models.hf  # noqa: E402,F401  (registers attn_implementation="bytescale")
from bytescale.attention import Layout, micro_batch_context  # noqa: E402
from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig  # noqa: E402
from bytescale.data import IGNORE_INDEX, HDPLoader, SyntheticTokens  # noqa: E402
from bytescale.runtime import token_level_loss  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

V = 64
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
LENGTHS = [400, 13, 211, 97, 45, 7, 150, 31, 64, 9, 120, 5, 77, 330]  # plans with rings of 2, 3 and 4
CAPACITY, TOKENS_PER_BATCH, STEPS = 110, 1000, 2


def _config(family: str, **kw):
    if family == "llama":
        return transformers.LlamaConfig(**SIZES, **kw)
    if family == "qwen2":
        return transformers.Qwen2Config(**SIZES, **kw)
    if family == "mixtral":
        return transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2, **kw)
    raise ValueError(family)


def test_what_users_write_selects_bytescale(tmp_path):
    Auto = transformers.AutoModelForCausalLM
    assert Auto.from_config(_config("llama"), attn_implementation="bytescale").config._attn_implementation == "bytescale"
    on_config = transformers.LlamaForCausalLM(_config("llama", attn_implementation="bytescale"))
    assert on_config.config._attn_implementation == "bytescale"
    m = transformers.LlamaForCausalLM(_config("llama"))
    m.set_attn_implementation("bytescale")
    assert m.config._attn_implementation == "bytescale"
    m.save_pretrained(tmp_path)
    loaded = Auto.from_pretrained(tmp_path, attn_implementation="bytescale")
    assert loaded.config._attn_implementation == "bytescale"
    # and it really is bytescale's attention: packed documents attend only within themselves
    eager = Auto.from_pretrained(tmp_path, attn_implementation="eager")
    lens = [9, 4, 13]
    ids = torch.randint(0, V, (sum(lens),))
    pos = torch.cat([torch.arange(n) for n in lens])
    with micro_batch_context(Layout.local(lens)):
        packed = loaded(input_ids=ids[None], position_ids=pos[None]).logits[0]
    ref = torch.cat([eager(input_ids=d[None]).logits[0] for d in ids.split(lens)])
    torch.testing.assert_close(packed, ref, rtol=1e-4, atol=1e-5)


def _model(family):
    torch.manual_seed(0)
    # Mixtral's default grouped-GEMM experts have no float64 kernel: the eager loop for the test
    kw = {"experts_implementation": "eager"} if family == "mixtral" else {}
    return transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="bytescale",
                                                         dtype=torch.float64, **kw)


def _loader(world, rank=0, capacity=CAPACITY, **kw):
    return HDPLoader(SyntheticTokens(LENGTHS, vocab_size=V, seed=2), PlannerConfig(capacity),
                     LoaderConfig(TOKENS_PER_BATCH, seed=1, max_steps=STEPS, **kw), rank=rank, world_size=world)


def _reference(family, world):
    ds = SyntheticTokens(LENGTHS, vocab_size=V, seed=2)
    model = _model(family)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    grads = []
    for step in _loader(world, check_plan=False, prefetch=False):
        docs = [ds.tokens(i, 0, ds.length(i)) for i in step.sample_ids]
        labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        with micro_batch_context(Layout.local([len(d) for d in docs])):
            logits = model(input_ids=torch.cat(docs)[None], position_ids=pos[None]).logits[0]
        token_level_loss(logits, labels, step.global_loss_tokens).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


def _hdp(rank, world, families, checkpointing=False):
    from bytescale import HybridDataParallel

    out = {}
    for family in families:
        net = _model(family)
        if checkpointing:
            if hasattr(net, "activation_checkpointing_enable"):  # transformers >= 5.x
                net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            net.train()
        model = HybridDataParallel(net, config=RuntimeConfig(bucket_cap_mb=0.01))
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        steps = []
        for step in _loader(world, rank):
            mbs = step.micro_batches
            for i, mb in enumerate(mbs):
                with model.micro_batch(mb, last=i == len(mbs) - 1):  # the layout reaches HF's attention here
                    logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None]).logits[0]
                    token_level_loss(logits, mb.labels, step.global_loss_tokens).backward()
            model.finish_step()
            steps.append(([p.grad.clone() for p in model.module.parameters()],
                          sorted(len(m.plan.ring) for m in mbs if m.plan.is_ring)))
            opt.step()
            opt.zero_grad()
        out[family] = steps
    return out


def test_hf_models_under_hdp_match_single_process_with_rings_of_2_3_4():
    families = ("llama", "qwen2", "mixtral")
    world = 4
    per_rank = run_distributed(_hdp, world, families, timeout=400)
    for family in families:
        ref = _reference(family, world)
        for s, want in enumerate(ref):
            for r in per_rank:
                for g, w in zip(r[family][s][0], want):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"{family} step {s}: {m}")
    rings = {n for r in per_rank for st in r["llama"] for n in st[1]}
    assert {2, 3, 4} <= rings, rings


def test_hf_with_activation_checkpointing_in_cuda_order(monkeypatch):
    """Issue 21 finding 4 under HDP: CUDA's execution model on CPU (BYTESCALE_NCCL_ORDER=1:
    backward, and so the checkpoint's recompute, on a separate thread; one in-order queue of
    communication per rank). The layout must reach the recompute, rings included."""
    monkeypatch.setenv("BYTESCALE_NCCL_ORDER", "1")
    world = 4  # the longest document needs 4 ranks at CAPACITY
    per_rank = run_distributed(_hdp, world, ("llama",), True, timeout=400, pg_timeout=60)
    for s, want in enumerate(_reference("llama", world)):
        for r in per_rank:
            for g, w in zip(r["llama"][s][0], want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {s}: {m}")
    assert any(st[1] for r in per_rank for st in r["llama"]), "no ring in the plans"


def _hdp_tp(rank, world, families):
    """HDP 2 x TP 2: each HF model under its own transformers TP plan inside the unit."""
    import bytescale
    from bytescale import HybridDataParallel
    from bytescale.models.parallel import hf_tensor_parallel

    mesh = bytescale.init_mesh(tp=2)
    out = {}
    for family in families:
        net = hf_tensor_parallel(_model(family), mesh["tp"])
        model = HybridDataParallel(net, process_group=mesh.group("hdp"), config=RuntimeConfig(bucket_cap_mb=0.01))
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        steps = []
        for step in _loader(world, rank, capacity=2 * CAPACITY):  # plans mesh.units: 2 units of 2 TP ranks
            mbs = step.micro_batches
            for i, mb in enumerate(mbs):
                with model.micro_batch(mb, last=i == len(mbs) - 1):
                    logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None]).logits[0]
                    token_level_loss(logits, mb.labels, step.global_loss_tokens).backward()
            model.finish_step()
            steps.append(([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                           for p in net.parameters()],
                          sorted(len(m.plan.ring) for m in mbs if m.plan.is_ring),
                          sum(hasattr(p, "full_tensor") for p in net.parameters())))
            opt.step()
            opt.zero_grad()
        out[family] = steps
    return out


@pytest.mark.timeout(1200)
def test_hf_models_under_hdp2_tp2_with_their_tp_plans_match_single_process():
    families = ("llama", "qwen2")
    # fresh processes: in a world that earlier bodies had used, transformers' TP output redistribute
    # once met a DeviceMesh group name of an earlier world ("Could not resolve the process group
    # registered under the name 7"; full pooled run of 2026-11-28, not reproduced alone, cause not
    # found): per-process state of torch / transformers that outlives destroy_process_group
    per_rank = run_distributed(_hdp_tp, 4, families, timeout=400, fresh=True)
    for family in families:
        ref = _reference(family, 4)  # the global batches do not depend on the world size
        for s, want in enumerate(ref):
            for r in per_rank:
                grads, _, sharded = r[family][s]
                assert sharded >= 7 * SIZES["num_hidden_layers"], f"{family}: the TP plan sharded {sharded} parameters"
                for g, w in zip(grads, want):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"{family} step {s}: {m}")
    assert {n for r in per_rank for st in r["llama"] for n in st[1]} >= {2}
