"""HF causal LMs cut into pipeline stages (bytescale.models.hf_pipeline_stage), single process.

For HF Llama, Qwen2, Mistral, Qwen3 and Mixtral (tiny random configs, float64), the stages chained
by hand (each stage's output as the next one's ``hidden=``), under a layout of several local
documents, give the whole model's logits, and after backward of the same loss the same gradients
for every parameter (each on the stage that holds it, under the whole model's name), for 2 and 3
stages; also with activation checkpointing (the recomputation runs under the layout too, outside
the caller's scope). Built by the trainer's code (``--model config.json --pp 2``) the stages give
the whole model's gradients across 2 processes, and across PP 2 x HDP 2 with ring attention on each
stage's ring. The chained and multi-process tests are marked ``nccl_order`` (also run under CUDA's
execution model on CPU: backward and its recompute on another thread). What cannot be cut is
refused with a clear ValueError (a ConfigError through the trainer).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bytescale.models.hf  # noqa: E402,F401  (registers attn_implementation="bytescale")
from bytescale.attention import Layout, micro_batch_context  # noqa: E402
from bytescale.models import hf_pipeline_stage  # noqa: E402

V, LAYERS = 64, 6
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
LENS = [9, 1, 23, 4, 14]


def _config(family: str, **kw):
    kw = {**SIZES, **kw}
    if family == "llama":
        return transformers.LlamaConfig(**kw)
    if family == "qwen2":
        return transformers.Qwen2Config(**kw)
    if family == "qwen3":
        return transformers.Qwen3Config(**kw)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=None, **kw)
    if family == "mixtral":
        return transformers.MixtralConfig(sliding_window=None, num_local_experts=4, num_experts_per_tok=2, **kw)
    raise ValueError(family)


def _model(family: str, **kw):
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if family == "mixtral" else {}  # float64 experts
    return transformers.AutoModelForCausalLM.from_config(_config(family, **kw), attn_implementation="bytescale",
                                                         dtype=torch.float64, **extra)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (sum(LENS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENS])
    labels = torch.randint(0, V, (sum(LENS),), generator=g)
    return ids, pos, labels


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / 50.0


def _whole(family):
    """The unsplit model: logits of the packed batch and its gradients, by parameter name."""
    model = _model(family)
    ids, pos, labels = _batch()
    with micro_batch_context(Layout.local(LENS)):
        logits = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
        _loss(logits, labels).backward()
    # independent of the layout: each document alone through the unsplit model
    with torch.no_grad():
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in ids.split(LENS)])
    torch.testing.assert_close(logits.detach(), alone, rtol=1e-6, atol=1e-7)
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _chained(family, stages, checkpointing=False):
    """The stages run one after the other, each from a whole model built alike."""
    ids, pos, labels = _batch()
    layout = Layout.local(LENS)
    parts = [hf_pipeline_stage(_model(family), s, stages) for s in range(stages)]
    hidden, outs, auxes = None, [], []
    for s, part in enumerate(parts):
        part.activation_checkpointing = checkpointing
        inp = None if hidden is None else hidden.detach().requires_grad_(True)
        out, aux = part(ids if s == 0 else None, pos, layout=layout, global_tokens=sum(LENS), return_aux=True,
                        hidden=inp)
        outs.append((inp, out))
        auxes.append(aux)
        hidden = out
    logits = hidden
    # backward stage by stage, as a pipeline does: the last from the loss, the others from the
    # gradient of their output (each stage's backward outside any layout scope of the caller)
    grad = None
    for s in reversed(range(stages)):
        inp, out = outs[s]
        if s == stages - 1:
            _loss(out, labels).backward()
        else:
            out.backward(grad)
        grad = None if inp is None else inp.grad
    grads = {}
    for part in parts:
        for n, p in part.named_parameters():
            assert n not in grads, n
            grads[n] = p.grad
    return parts, logits.detach(), grads, auxes


FAMILIES = ["llama", "qwen2", "mistral", "qwen3", "mixtral"]


@pytest.mark.nccl_order
@pytest.mark.parametrize("family", FAMILIES)
def test_chained_stages_equal_the_whole_model(family):
    ref_logits, ref_grads = _whole(family)
    for stages in (2, 3):
        for ckpt in ((False, True) if family in ("llama", "qwen2") and stages == 3 else (False,)):
            parts, logits, grads, auxes = _chained(family, stages, ckpt)
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-12)
            assert sorted(grads) == sorted(ref_grads), (stages, set(grads) ^ set(ref_grads))
            for n, g in grads.items():
                assert g is not None, (family, stages, n)
                torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=1e-12, msg=lambda m: f"{n}: {m}")
            for s, (part, aux) in enumerate(zip(parts, auxes)):
                assert (part.stage, part.stages, part.hidden_size, part.takes_layout) == (s, stages, 32, True)
                assert aux.dim() == 0 and aux.item() == 0.0
                per = LAYERS // stages
                assert list(part.layers.keys()) == [str(i) for i in range(s * per, (s + 1) * per)]
                assert (part.model.embed_tokens is not None) == (s == 0)
                assert (part.lm_head is not None) == (part.model.norm is not None) == (s == stages - 1)


def test_hidden_shapes_and_first_stage_inputs():
    ids, pos, _ = _batch()
    first, last = (hf_pipeline_stage(_model("llama"), s, 2) for s in range(2))
    h = first(ids, pos, layout=Layout.local(LENS))
    assert h.shape == (sum(LENS), 32)
    assert last(None, pos, layout=Layout.local(LENS), hidden=h).shape == (sum(LENS), V)
    with pytest.raises(ValueError, match=r"takes hidden= \(T, 32\)"):
        last(ids, pos, layout=Layout.local(LENS))
    with pytest.raises(ValueError, match="takes packed 1-D input_ids"):
        first(None, pos, hidden=h)


def test_what_cannot_be_cut_is_refused():
    with pytest.raises(ValueError, match="4 stages do not divide the model's 6 layers"):
        hf_pipeline_stage(_model("llama"), 0, 4)
    with pytest.raises(ValueError, match=r"stage 3 outside \[0, 3\)"):
        hf_pipeline_stage(_model("qwen2"), 3, 3)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        hf_pipeline_stage(_model("qwen2", tie_word_embeddings=True), 0, 2)
    whole = hf_pipeline_stage(_model("qwen2", tie_word_embeddings=True), 0, 1)  # one stage: nothing to sum
    assert whole.lm_head.weight is whole.model.embed_tokens.weight
    with pytest.raises(ValueError, match="sliding-window attention"):
        hf_pipeline_stage(transformers.AutoModelForCausalLM.from_config(
            transformers.MistralConfig(**SIZES, sliding_window=16), attn_implementation="bytescale"), 0, 2)
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        hf_pipeline_stage(transformers.AutoModelForCausalLM.from_config(
            _config("llama"), attn_implementation="eager"), 0, 2)
    m = _model("llama")
    hf_pipeline_stage(m, 0, 2)
    with pytest.raises(ValueError, match="already a pipeline stage"):
        hf_pipeline_stage(m, 1, 2)


def test_an_empty_micro_batch_runs_one_dummy_token_that_counts_zero():
    """HF layers cannot run 0 tokens; a stage given none returns (0, ...) outputs and gives every
    parameter (and the input hidden) a zero gradient, so gradient hooks fire alike on every rank."""
    first, last = (hf_pipeline_stage(_model("qwen2"), s, 2) for s in range(2))
    ids = torch.zeros(0, dtype=torch.long)
    h, aux = first(ids, ids, layout=Layout.local([]), return_aux=True)
    inp = h.detach().requires_grad_(True)
    out, _ = last(None, ids, layout=Layout.local([]), return_aux=True, hidden=inp)
    assert h.shape == (0, 32) and out.shape == (0, V) and aux.item() == 0.0
    out.sum().backward()
    h.backward(inp.grad)
    assert inp.grad.shape == (0, 32)
    for p in list(first.parameters()) + list(last.parameters()):
        assert p.grad is not None and not p.grad.any()


def _built_stage_worker(rank, world, paths):
    """``--model config.json --pp 2`` through the trainer's build_model and parallelize, then one
    forward and backward of the batch across the two ranks by hand over the mesh's channels."""
    import torch.distributed as dist

    import bytescale
    from bytescale.train.build import build_model, parallelize
    from bytescale.train.config import parse_args

    mesh = bytescale.init_mesh(pp=2)
    cpu = torch.device("cpu")
    ids, pos, labels = _batch()
    layout, T = Layout.local(LENS), sum(LENS)
    out = {}
    for family, path in paths.items():
        cfg = parse_args(["--model", path, "--pp", "2", "--data", "synthetic:byted", "--dtype", "float64",
                          "--activation-checkpointing"])
        model, info = build_model(cfg, 0, cpu)
        wrapped, _ = parallelize(model, info, cfg, cpu, mesh)
        stage = wrapped.module
        fwd, bwd = mesh.p2p_group("fwd", 0), mesh.p2p_group("bwd", 0)
        if mesh.stage == 0:
            h, _ = stage(ids, pos, layout=layout, global_tokens=T, return_aux=True)
            dist.send(h.detach().contiguous(), dst=1, group=fwd)
            g = torch.empty_like(h)
            dist.recv(g, src=1, group=bwd)
            h.backward(g)
        else:
            h = torch.empty(T, stage.hidden_size, dtype=torch.float64)
            dist.recv(h, src=0, group=fwd)
            h.requires_grad_(True)
            logits, _ = stage(None, pos, layout=layout, global_tokens=T, return_aux=True, hidden=h)
            _loss(logits, labels).backward()
            dist.send(h.grad.contiguous(), dst=0, group=bwd)
        out[family] = (type(stage).__name__, stage.stage, stage.stages, stage.activation_checkpointing,
                       {n: p.grad.clone() for n, p in stage.named_parameters()})
    return out


@pytest.mark.nccl_order
def _saved_configs(tmp_path) -> dict:
    """HF Llama and Qwen2 configs saved as config.json files: family -> path."""
    paths = {}
    for family in ("llama", "qwen2"):
        _config(family).save_pretrained(tmp_path / family)
        paths[family] = str(tmp_path / family / "config.json")
    return paths


def test_the_trainer_builds_hf_stages_with_pp(tmp_path):
    """``--model config.json --pp 2`` builds each rank's HFPipelineStage (activation checkpointing
    on it), and the two stages run by hand across two processes give the whole model's gradients
    (the whole model built by the same build_model, the same init seed). The step executor's 1F1B
    over such stages: tests/train/test_train_compose.py."""
    from dist_utils import run_distributed
    from bytescale.train.build import build_model
    from bytescale.train.config import parse_args

    paths = _saved_configs(tmp_path)
    results = run_distributed(_built_stage_worker, 2, paths, timeout=300)
    ids, pos, labels = _batch()
    for family, path in paths.items():
        cfg = parse_args(["--model", path, "--data", "synthetic:byted", "--dtype", "float64"])
        whole, info = build_model(cfg, 0, torch.device("cpu"))
        assert info.kind == "hf"
        with micro_batch_context(Layout.local(LENS)):
            logits = whole(input_ids=ids[None], position_ids=pos[None]).logits[0]
            _loss(logits, labels).backward()
        ref = {n: p.grad for n, p in whole.named_parameters()}
        seen = set()
        for rank, res in enumerate(results):
            kind, stage, stages, ckpt, grads = res[family]
            assert (kind, stage, stages, ckpt) == ("HFPipelineStage", rank, 2, True)
            for n, g in grads.items():
                torch.testing.assert_close(g, ref[n], rtol=0, atol=1e-12, msg=lambda m: f"{family} {n}: {m}")
            seen |= set(grads)
        assert seen == set(ref), set(ref) ^ seen


def test_the_trainer_refuses_what_an_hf_stage_cannot_do(tmp_path):
    """Refusals of ``--model config.json --pp P`` come as ConfigErrors naming the option: TP inside
    an HF stage, tied embeddings, a depth that does not divide the layers."""
    from types import SimpleNamespace

    from bytescale.train.build import build_model, parallelize
    from bytescale.train.config import ConfigError, parse_args

    def build(hf_cfg, pp, tp=1):
        hf_cfg.save_pretrained(tmp_path)
        cfg = parse_args(["--model", str(tmp_path / "config.json"), "--pp", str(pp), "--data", "synthetic:byted"])
        model, info = build_model(cfg, 0, torch.device("cpu"))
        mesh = SimpleNamespace(ep=1, pp=pp, tp=tp, stage=0)  # refused before any group is used
        return parallelize(model, info, cfg, torch.device("cpu"), mesh)

    with pytest.raises(ConfigError, match=r"hdp.pp=2 .*tensor parallelism \(tp=2\) inside an HF model's pipeline"):
        build(_config("llama"), 2, tp=2)
    with pytest.raises(ConfigError, match="hdp.pp=2 .*tie_word_embeddings=False"):
        build(_config("qwen2", tie_word_embeddings=True), 2)
    with pytest.raises(ConfigError, match="hdp.pp=4 .*4 stages do not divide the model's 6 layers"):
        build(_config("llama"), 4)


def test_bytescale_llama_states_the_same_stage_protocol():
    from bytescale.models import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48)
    first, last = (Llama(cfg).pipeline_stage(s, 2) for s in range(2))
    ids, pos, _ = _batch()
    layout = Layout.local(LENS)
    for part in (first, last):
        assert (part.takes_layout, part.hidden_size, part.stages) == (True, 32, 2)
    h, aux0 = first(ids, pos, layout=layout, global_tokens=sum(LENS), return_aux=True)
    logits, aux1 = last(None, pos, layout=layout, global_tokens=sum(LENS), return_aux=True, hidden=h)
    assert h.shape == (sum(LENS), 32) and logits.shape == (sum(LENS), V)
    assert aux0.dim() == aux1.dim() == 0


def test_one_layout_scope_per_forward_and_per_recompute(monkeypatch):
    """The stage opens one micro_batch_context per forward (ring calls are agreed once for all its
    layers, not once per layer), none when the caller's is already the layout, and one per
    recomputed layer in backward when no caller scope is open (the recompute needs the layout)."""
    import bytescale.models.hf_stage as hs

    opened = []
    real = hs.micro_batch_context

    def counting(layout):
        opened.append(layout)
        return real(layout)

    monkeypatch.setattr(hs, "micro_batch_context", counting)
    ids, pos, labels = _batch()
    layout = Layout.local(LENS)
    part = hf_pipeline_stage(_model("llama"), 0, 1)
    part(ids, pos, layout=layout)
    assert len(opened) == 1
    with real(layout):
        part(ids, pos, layout=layout)
    assert len(opened) == 1
    part.activation_checkpointing = True
    out = part(ids, pos, layout=layout)
    assert len(opened) == 2
    _loss(out, labels).backward()
    assert len(opened) == 2 + LAYERS and all(x is layout for x in opened)


SHARDED = 40  # one document sharded zig-zag over each stage's ring of the two HDP units
UNIT_LENS = ([9, 1], [23, 4])


def _ring_worker(rank, world, paths):
    """PP 2 x HDP 2: each stage's two units hold local documents and share one sharded document
    through ring attention (the ring of the stage's units), built by the trainer's code with
    activation checkpointing, run by hand across the boundary; gradients summed over HDP."""
    import torch.distributed as dist

    import bytescale
    from bytescale.attention.layout import shard
    from bytescale.train.build import build_model, parallelize
    from bytescale.train.config import parse_args

    mesh = bytescale.init_mesh(pp=2)
    cpu = torch.device("cpu")
    h_idx = mesh.coords()["hdp"]
    ring = mesh.ranks("hdp")
    ids, pos, labels = _ring_batch()
    local = sum(UNIT_LENS[0]) if h_idx == 0 else sum(UNIT_LENS[1])
    start = 0 if h_idx == 0 else sum(UNIT_LENS[0])
    tail = slice(sum(map(sum, UNIT_LENS)), None)

    def mine(t):
        return torch.cat([t[start:start + local], shard(t[tail], [SHARDED], 2, ring.index(rank))])

    my_ids, my_pos, my_labels = mine(ids), mine(pos), mine(labels)
    layout = Layout.for_rank(UNIT_LENS[h_idx], [SHARDED], ring, rank=rank)
    T = my_ids.shape[0]
    out = {}
    for family, path in paths.items():
        cfg = parse_args(["--model", path, "--pp", "2", "--data", "synthetic:byted", "--dtype", "float64",
                          "--activation-checkpointing"])
        model, info = build_model(cfg, 0, cpu)
        stage = parallelize(model, info, cfg, cpu, mesh)[0].module
        fwd, bwd = mesh.p2p_group("fwd", 0), mesh.p2p_group("bwd", 0)
        peer = mesh.ranks("pp")[1 - mesh.stage]
        if mesh.stage == 0:
            hid, _ = stage(my_ids, my_pos, layout=layout, return_aux=True)
            dist.send(hid.detach().contiguous(), dst=peer, group=fwd)
            g = torch.empty_like(hid)
            dist.recv(g, src=peer, group=bwd)
            hid.backward(g)
        else:
            hid = torch.empty(T, stage.hidden_size, dtype=torch.float64)
            dist.recv(hid, src=peer, group=fwd)
            hid.requires_grad_(True)
            logits, _ = stage(None, my_pos, layout=layout, return_aux=True, hidden=hid)
            _loss(logits, my_labels).backward()
            dist.send(hid.grad.contiguous(), dst=peer, group=bwd)
        grads = {}
        for n, p in stage.named_parameters():
            dist.all_reduce(p.grad, group=mesh.group("hdp"))
            grads[n] = p.grad
        out[family] = (mesh.stage, grads)
    return out


def _ring_batch():
    lens = UNIT_LENS[0] + UNIT_LENS[1] + [SHARDED]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (sum(lens),), generator=g)
    return ids, torch.cat([torch.arange(n) for n in lens]), torch.randint(0, V, (sum(lens),), generator=g)


@pytest.mark.nccl_order
def test_hf_stages_with_ring_attention_across_hdp_units(tmp_path):
    """Four processes, PP 2 x HDP 2, a document sharded over each stage's ring, activation
    checkpointing on: the HDP-summed gradients of both stages equal the whole model's on the whole
    batch (float64)."""
    from dist_utils import run_distributed
    from bytescale.train.build import build_model
    from bytescale.train.config import parse_args

    paths = _saved_configs(tmp_path)
    results = run_distributed(_ring_worker, 4, paths, timeout=300)
    ids, pos, labels = _ring_batch()
    lens = UNIT_LENS[0] + UNIT_LENS[1] + [SHARDED]
    for family, path in paths.items():
        whole, _ = build_model(parse_args(["--model", path, "--data", "synthetic:byted", "--dtype", "float64"]), 0,
                               torch.device("cpu"))
        with micro_batch_context(Layout.local(lens)):
            _loss(whole(input_ids=ids[None], position_ids=pos[None]).logits[0], labels).backward()
        ref = {n: p.grad for n, p in whole.named_parameters()}
        seen = set()
        for res in results:
            stage, grads = res[family]
            for n, g in grads.items():
                torch.testing.assert_close(g, ref[n], rtol=1e-9, atol=1e-11, msg=lambda m: f"{family} {n}: {m}")
            seen |= set(grads)
        assert seen == set(ref)
