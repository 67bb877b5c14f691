"""An HF Mixtral (transformers' ``MixtralForCausalLM``) on the package's MoE: HF's routing, the
package's dropless all-to-all dispatch over EP groups, HF's balance loss made exact under HDP
(:mod:`bytescale.models.hf_moe`).

Single process: the replaced blocks give the unmodified model's logits exactly; the balance loss
is HF's ``load_balancing_loss_func`` for one layer and one document; expert weights convert
between HF's fused names and the per-expert ones; what is not Mixtral is refused.

Multi-process: a tiny float64 Mixtral (4 experts, top-2, 2 layers, untied embeddings) trained
with SGD at HDP 4 with EP 2, and EP 4 with activation checkpointing, through the HDP loader and
the step executor (the EP lockstep slots: ranks without a micro-batch join the all-to-alls) gives
every step's loss and balance loss, and every parameter (experts by global name), of single-process
training of the UNMODIFIED HF model on the same global batches, whose balance loss is written here
independently from its router logits: per layer and whole document, ``E * sum_e (count_e / n) *
mean prob_e``, weighted by ``n / G`` and averaged over layers, times ``router_aux_loss_coef``.
HF's RMSNorm and router softmax compute in float32, so agreement is to ~1e-7, not float64's.
"""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bytescale.models.hf  # noqa: E402,F401  (registers attn_implementation="bytescale")
from bytescale.attention import Layout, micro_batch_context  # noqa: E402
from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig  # noqa: E402
from bytescale.data import IGNORE_INDEX, HDPLoader, SyntheticTokens  # noqa: E402
from bytescale.models.hf_moe import fused_expert_weights, hf_moe_model, split_expert_weights  # noqa: E402
from bytescale.runtime import token_level_loss  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

V, E, K, LAYERS, COEF = 64, 4, 2, 2, 0.5
LENGTHS = [250, 9, 13, 7, 45, 3, 130, 31, 64, 150, 22, 5, 77, 1, 40, 210, 2, 17]
TOKENS_PER_BATCH, CAPACITY, STEPS, WORLD, LR = 300, 100, 3, 4, 0.5


def _config(layers=LAYERS, **kw):
    kw = dict(dict(vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K,
                   tie_word_embeddings=False, sliding_window=None, router_aux_loss_coef=COEF,
                   max_position_embeddings=512), **kw)
    return transformers.MixtralConfig(**kw)


def _hf(layers=LAYERS, **kw):
    torch.manual_seed(0)
    # HF's grouped-GEMM experts have no float64 kernel: its eager loop for the reference
    return transformers.AutoModelForCausalLM.from_config(_config(layers, **kw), attn_implementation="bytescale",
                                                         dtype=torch.float64, experts_implementation="eager")


def _dataset():
    return SyntheticTokens(LENGTHS, vocab_size=V, seed=3)


def _loader(rank=0, **kw):
    return HDPLoader(_dataset(), PlannerConfig(CAPACITY), LoaderConfig(TOKENS_PER_BATCH, seed=15, max_steps=STEPS, **kw),
                     rank=rank, world_size=WORLD)


def _reference_aux(router_logits, lens, global_tokens):
    """The balance loss from the unmodified model's router logits (module docstring)."""
    total = 0.0
    for logits in router_logits:  # one (T, E) tensor per layer
        for lg in logits.split(lens):
            n = lg.shape[0]
            probs = torch.softmax(lg, -1)
            chosen = torch.softmax(lg.float(), -1).topk(K, dim=-1).indices  # HF's routing
            counts = torch.nn.functional.one_hot(chosen, E).sum((0, 1)).to(probs.dtype)
            total = total + (n / global_tokens) * E * ((counts / n) * probs.mean(0)).sum()
    return COEF * total / len(router_logits)


def _named(model):
    """Parameters by the per-expert names (HF's fused experts split)."""
    return split_expert_weights({k: v.detach() for k, v in model.named_parameters()})


@functools.lru_cache(maxsize=1)
def _reference():
    ds, model = _dataset(), _hf()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in _loader(check_plan=False, prefetch=False):
        docs = [ds.tokens(i, 0, ds.length(i)) for i in step.sample_ids]
        lens = [len(d) for d in docs]
        labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
        pos = torch.cat([torch.arange(n) for n in lens])
        with micro_batch_context(Layout.local(lens)):
            res = model(input_ids=torch.cat(docs)[None], position_ids=pos[None], output_router_logits=True)
        loss = token_level_loss(res.logits[0], labels, step.global_loss_tokens)
        aux = _reference_aux(res.router_logits, lens, step.global_tokens)
        (loss + aux).backward()
        opt.step()
        opt.zero_grad()
        out.append((list(step.sample_ids), float(loss.detach()), float(aux.detach())))
    return _named(model), out


def test_blocks_give_hf_logits_and_hf_balance_loss_for_one_layer():
    ref, ours = _hf(1), hf_moe_model(_hf(1))
    ids, pos = torch.randint(0, V, (40,)), torch.arange(40)
    res = ref(input_ids=ids[None], position_ids=pos[None], output_router_logits=True)
    logits, aux = ours(ids, pos, layout=Layout.local([40]), global_tokens=40, return_aux=True)
    assert torch.equal(logits, res.logits[0])
    assert float(aux.detach()) == pytest.approx(COEF * float(res.aux_loss.detach()), rel=1e-6)  # HF's is float32
    # two documents of the global batch's 60 tokens: each its share of the loss, HF's per document
    lens = [25, 15]
    pos2 = torch.cat([torch.arange(n) for n in lens])
    _, aux2 = ours(ids, pos2, layout=Layout.local(lens), global_tokens=60, return_aux=True)
    want = sum(n / 60 * COEF * float(ref(input_ids=d[None], output_router_logits=True).aux_loss.detach())
               for n, d in zip(lens, ids.split(lens)))
    assert float(aux2.detach()) == pytest.approx(want, rel=1e-6)
    # expert names: per expert at any EP degree, HF's fused form recovered exactly
    fused = fused_expert_weights({k: v.detach() for k, v in ours.named_parameters()}, E)
    assert fused.keys() == dict(ref.named_parameters()).keys()
    for k, v in ref.named_parameters():
        assert torch.equal(fused[k], v.detach()), k


def test_what_is_not_a_mixtral_is_refused():
    llama = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2), attn_implementation="bytescale")
    with pytest.raises(ValueError, match="not one of"):
        hf_moe_model(llama)
    with pytest.raises(ValueError, match="router_jitter_noise"):
        hf_moe_model(_hf(router_jitter_noise=0.1))


def _worker(rank, world, ep, act_ckpt):
    import bytescale
    from bytescale import HybridDataParallel
    from bytescale.models import expert_parallel
    from bytescale.models.expert_parallel import expert_norm_groups
    from bytescale.runtime import StepExecutor
    from bytescale.runtime.grad import grad_norm

    mesh = bytescale.init_mesh(ep=ep)
    net = expert_parallel(_hf(), mesh)  # an HF Mixtral: the package's MoE blocks, then its experts sharded
    net.activation_checkpointing = act_ckpt
    model = HybridDataParallel(net, config=RuntimeConfig(bucket_cap_mb=0.01))
    executor = StepExecutor(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    stats = []
    loader = _loader(rank)
    try:
        for step in loader:
            out = executor.run(step)
            norm = float(grad_norm(model.parameters(), expert_norm_groups(net)))
            opt.step()
            opt.zero_grad()
            stats.append({"ids": list(step.sample_ids), "loss": out.loss, "aux": out.aux, "norm": norm,
                          "real": out.micro_batches, "rings": [len(m.plan.ring) for m in step.micro_batches]})
    finally:
        loader.close()
    return {"params": {k: v.detach() for k, v in net.named_parameters()}, "stats": stats, "kind": executor.kind.describe(),
            "ep_size": net.ep_size, "hdp": mesh.coords()["hdp"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep,act_ckpt", [(2, False), (4, True)])
def test_hf_mixtral_with_ep_matches_single_process_float64(ep, act_ckpt):
    ref, steps = _reference()
    res = run_distributed(_worker, WORLD, ep, act_ckpt, timeout=240)
    per = E // ep
    for rank, r in enumerate(res):
        assert r["ep_size"] == ep and f"blocks of {ep}" in r["kind"], r["kind"]
        assert [s["ids"] for s in r["stats"]] == [s[0] for s in steps]
        j = r["hdp"] % ep
        mine = {k for k in ref if ".experts." not in k or int(k.split(".experts.")[1].split(".")[0]) // per == j}
        assert r["params"].keys() == mine, (rank, sorted(r["params"].keys() ^ mine))
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref[k], rtol=1e-6, atol=1e-8, msg=lambda m: f"rank {rank} {k}: {m}")
    for k, (_, loss, aux) in enumerate(steps):
        assert sum(r["stats"][k]["loss"] for r in res) == pytest.approx(loss, rel=1e-7)
        assert sum(r["stats"][k]["aux"] for r in res) == pytest.approx(aux, rel=1e-7)
        assert len({round(r["stats"][k]["norm"], 9) for r in res}) == 1
    real = [[r["stats"][k]["real"] for r in res] for k in range(STEPS)]
    assert any(0 in row for row in real), f"no step left a rank without a micro-batch: {real}"
    assert {n for r in res for s in r["stats"] for n in s["rings"]} >= {2, 3}
