"""Building a run's pieces from its config: the dataset, the model, its parallelisation.

Models: a preset name builds bytescale's own Llama (:mod:`bytescale.models.presets`); a path to
an HF ``config.json`` (or a directory holding one) builds
``AutoModelForCausalLM.from_config(config, attn_implementation="bytescale")``, randomly
initialised from ``model.init_seed`` (the same on every rank).

An HF Mixtral (tp=1) runs on the package's MoE blocks at every EP degree
(:func:`bytescale.models.hf_moe.hf_moe_model`: HF's routing, the package's dispatch, the balance
loss made exact under HDP), its experts sharded by ``--ep``.

Parallelisation, in TorchTitan's order: this rank's pipeline stage (``--pp``: bytescale's
``Llama.pipeline_stage``, or :func:`bytescale.models.hf_pipeline_stage` for an HF model), tensor
parallelism inside each HDP unit (the mesh's "tp" dimension:
:func:`bytescale.models.parallel.tensor_parallel` for bytescale's Llama, the model's own
transformers plan for HF models; not inside an HF pipeline stage yet), activation checkpointing per
block, ``torch.compile`` per block, FSDP2 ``fully_shard`` per block then the root over the mesh's
"hdp" dimension (expert-parallel experts, sharded first by
:func:`bytescale.models.expert_parallel.expert_parallel`, left out of it), and finally
:class:`bytescale.HybridDataParallel` (replicated parameters: gradients summed once a step over the
ranks of the same TP index; FSDP2: the wrapper makes its reduce-scatter a sum and syncs on the last
micro-batch).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from ..data.oversize import DocumentView, OversizeError  # the library's split (re-exported here)
from .config import ConfigError, TrainConfig
from .metrics import FlopsModel

__all__ = ["ModelInfo", "DocumentView", "LengthRecorder", "build_dataset", "open_service", "build_model",
           "parallelize", "build_optimizer", "is_hf_config"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_HF_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "num_local_experts",
                 "num_experts_per_tok", "tie_word_embeddings", "attention_bias", "mlp_bias")


# -- data -----------------------------------------------------------------------------------------

SplitDocuments = DocumentView


def _store_vocab(path: str, store: Any) -> int:
    """The vocabulary of a token store: prepare's summary.json, else its token dtype's range."""
    import json

    summary = Path(path) / "summary.json"
    if summary.is_file():
        try:
            v = int(json.loads(summary.read_text()).get("vocab_size") or 0)
            if v:
                return v
        except (ValueError, OSError):
            pass
    return 256 if np.dtype(store.dtype).itemsize == 1 else 0


def build_dataset(cfg: TrainConfig, max_len: int) -> Tuple[Any, int, str]:
    """(dataset, vocab size or 0, description) for ``--data``; documents longer than ``max_len``
    are handled as ``data.oversize`` says (the library's :class:`~bytescale.data.DocumentView`:
    split by default, skipped, or refused). The data service (``--data-spec``) is :func:`open_service`."""
    path = cfg.data.path
    if path is None:
        raise ConfigError("no data: give --data DIR (a token store), --data synthetic:byted, "
                          "or --data-spec FILE (a mixing spec)")
    if path.startswith("synthetic:"):
        from ..data import SyntheticTokens, sample_lengths

        corpus = path.split(":", 1)[1] or "byted"
        try:
            lengths = sample_lengths(corpus, cfg.data.synthetic_docs, seed=cfg.data.seed,
                                     scale=cfg.data.synthetic_scale, max_len=max_len)
        except ValueError as e:
            raise ConfigError(f"data.path {path!r}: {e}") from None
        vocab = cfg.model.vocab_size or 256
        ds = SyntheticTokens(lengths.tolist(), vocab_size=vocab, seed=cfg.data.seed)
        return ds, vocab, f"synthetic {corpus} corpus, {len(ds)} sequences"
    if not Path(path).is_dir():
        raise ConfigError(f"data.path {path!r}: not a directory (a token store from "
                          "python -m bytescale.data.prepare) and not synthetic:CORPUS")
    from ..data import TokenStore

    try:
        store = TokenStore(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.path {path!r}: not a readable token store ({e})") from None
    mode = cfg.data.oversize
    try:
        ds = DocumentView(store, max_len, cfg.data.length_scale, oversize=mode)
    except OversizeError as e:
        raise ConfigError(f"data.path {path!r}: {e}") from None
    scale = f", lengths x {cfg.data.length_scale:g}" if cfg.data.length_scale < 1 else ""
    how = {"split": "cut into pieces", "skip": "skipped", "error": "none"}[mode]
    return ds, _store_vocab(path, store), (f"token store {path}: {len(store)} documents{scale} -> {len(ds)} "
                                           f"documents of <= {max_len} tokens ({len(ds.oversize_ids)} longer: "
                                           f"{how}, data.oversize={mode})")


class LengthRecorder:
    """A :class:`~bytescale.data.BatchSource` that remembers each global batch's lengths (for the
    FLOP count), delegating everything else."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.lengths: Dict[int, Tuple[int, ...]] = {}
        # what HDPLoader's oversize handling reads of a data-service client
        self.source_names, self.longest = getattr(source, "source_names", None), getattr(source, "longest", None)

    def next_batch(self):
        b = self.source.next_batch()
        self.lengths[b.step] = tuple(b.lengths)
        if len(self.lengths) > 16:
            self.lengths.pop(min(self.lengths))
        return b

    def tokens(self, sample_id: int, start: int, end: int) -> torch.Tensor:
        return self.source.tokens(sample_id, start, end)

    def state_dict(self) -> Dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    def close(self) -> None:
        self.source.close()


def open_service(cfg: TrainConfig, rank: int):
    """``--data-spec``: rank 0 starts the data service (local engine), every rank connects.

    Returns (service on rank 0 else None, this rank's client, the spec's longest document or 0).
    """
    import torch.distributed as dist

    from ..data import DataService, MixingSpec, connect

    svc, msg, address, longest = None, None, None, 0
    if rank == 0:
        try:
            spec = MixingSpec.load(cfg.data.spec)
            longest = spec.longest() or 0
            svc = DataService(spec, tokens_per_batch=cfg.data.tokens_per_batch, seed=cfg.data.seed,
                              workers=cfg.data.workers)
            address = svc.address
        except (OSError, ValueError, RuntimeError, TimeoutError) as e:
            msg = f"data.spec {cfg.data.spec!r}: {e}"
    box = [msg, address, longest]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ConfigError(box[0])
    return svc, LengthRecorder(connect(box[1])), int(box[2])


# -- model ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """What the trainer needs to know about a model besides the module."""

    kind: str                      # "llama" (bytescale's) or "hf"
    flops: FlopsModel
    arch: Dict[str, Any]           # architecture fields a checkpoint must match
    params: int
    moe: bool


def is_hf_config(name: str) -> bool:
    p = Path(name)
    return name.endswith(".json") or (p.is_dir() and (p / "config.json").is_file())


def _active_matmul_params(model: nn.Module, embedding: Optional[nn.Module], expert_share: float) -> int:
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    n = 0.0
    for name, p in model.named_parameters():
        if id(p) in skip or p.dim() < 2:
            continue
        n += p.numel() * (expert_share if ".experts." in name else 1.0)
    return int(n)


def build_model(cfg: TrainConfig, data_vocab: int, device: torch.device) -> Tuple[nn.Module, ModelInfo]:
    mc = cfg.model
    dtype = _DTYPES[mc.dtype]
    torch.manual_seed(mc.init_seed)
    if is_hf_config(mc.name):
        return _build_hf(cfg, data_vocab, device, dtype)
    from ..models import Llama, preset

    over: Dict[str, Any] = {}
    if mc.experts >= 0:
        over["n_experts"] = mc.experts
    over["top_k"] = mc.top_k
    over["router_aux_coef"] = mc.router_aux_coef
    try:
        lc = preset(mc.name, vocab_size=mc.vocab_size or data_vocab or None, **over)
    except ValueError as e:
        raise ConfigError(f"model.name: {e}") from None
    if data_vocab and lc.vocab_size < data_vocab:
        raise ConfigError(f"model.vocab_size {lc.vocab_size} is smaller than the data's vocabulary {data_vocab}")
    with torch.device(device):
        model = Llama(lc).to(dtype)
    share = lc.top_k / lc.n_experts if lc.is_moe else 1.0
    arch = {k: v for k, v in dataclasses.asdict(lc).items() if k != "router_aux_coef"}
    arch["kind"] = "llama"
    info = ModelInfo("llama", FlopsModel(_active_matmul_params(model, model.embed, share), lc.n_layers,
                                         lc.n_heads, lc.head_dim), arch,
                     sum(p.numel() for p in model.parameters()), lc.is_moe)
    return model, info


def _build_hf(cfg: TrainConfig, data_vocab: int, device: torch.device, dtype: torch.dtype):
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.name {cfg.model.name!r} is an HF config, but transformers is not installed") from None
    from ..models import hf  # noqa: F401  (registers attn_implementation="bytescale")

    try:
        hcfg = transformers.AutoConfig.from_pretrained(cfg.model.name)
    except Exception as e:
        raise ConfigError(f"model.name {cfg.model.name!r}: cannot read the HF config: {e}") from None
    if cfg.model.vocab_size:
        hcfg.vocab_size = cfg.model.vocab_size
    if data_vocab and hcfg.vocab_size < data_vocab:
        raise ConfigError(f"model.name {cfg.model.name!r}: vocab_size {hcfg.vocab_size} is smaller than the "
                          f"data's vocabulary {data_vocab}")
    hcfg.use_cache = False
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation="bytescale", dtype=dtype)
    layers = hcfg.num_hidden_layers
    heads = hcfg.num_attention_heads
    head_dim = getattr(hcfg, "head_dim", None) or hcfg.hidden_size // heads
    n_exp = getattr(hcfg, "num_local_experts", 0) or 0
    share = (getattr(hcfg, "num_experts_per_tok", 1) / n_exp) if n_exp else 1.0
    d = hcfg.to_dict()
    arch = {k: d.get(k) for k in _HF_ARCH_KEYS if k in d}
    arch["kind"] = "hf"
    info = ModelInfo("hf", FlopsModel(_active_matmul_params(model, model.get_input_embeddings(), share),
                                      layers, heads, head_dim), arch,
                     sum(p.numel() for p in model.parameters()), bool(n_exp))
    return model, info


def blocks(model: nn.Module, info: ModelInfo) -> List[nn.Module]:
    """The transformer blocks (the unit of checkpointing, compilation and sharding)."""
    if info.kind == "llama" or getattr(model, "takes_layout", False):  # ours, or an HF pipeline stage
        return list(model.layers.values())
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ConfigError(f"{type(model).__name__}: cannot find its decoder layers (model.model.layers)")
    return list(layers)


def _hf_moe(model: nn.Module, info: ModelInfo, cfg: TrainConfig, mesh) -> nn.Module:
    """An HF Mixtral (tp=1) on the package's MoE blocks, this rank's stage of it: HF's routing, the
    package's dispatch (EP-shardable), the HDP-correct balance loss (:mod:`bytescale.models.hf_moe`),
    at every EP degree alike (so EP 1 and EP E train the same objective and expert names)."""
    from ..models.hf_moe import hf_moe_model, is_hf_moe

    if info.kind != "hf" or not is_hf_moe(model) or mesh.tp > 1:
        return model  # with tp > 1: HF's own model under its TP plan, no balance loss (EP refused)
    try:
        return hf_moe_model(model, mesh.stage if mesh.pp > 1 else 0, mesh.pp)
    except ValueError as e:
        raise ConfigError(f"model {cfg.model.name}: {e}") from None


def parallelize(model: nn.Module, info: ModelInfo, cfg: TrainConfig, device: torch.device, mesh=None):
    """Tensor parallelism, activation checkpointing, compile, FSDP2, HybridDataParallel (see module
    docstring). ``mesh``: the job's :class:`bytescale.Mesh` (default: the current one). With
    pipelines the model is cut to this rank's stage first (an HF model into a new module,
    :func:`bytescale.models.hf_pipeline_stage`): the returned wrapper's ``.module`` is the stage."""
    from .. import HybridDataParallel, current_mesh
    from .config import runtime_config

    run = cfg.train
    mesh = mesh or current_mesh()
    if mesh is None:
        raise ConfigError("parallelize: no mesh; call bytescale.init_mesh first")
    model = _hf_moe(model, info, cfg, mesh)
    if mesh.ep > 1:
        from ..models.expert_parallel import check_expert_parallel, expert_parallel

        try:
            if info.kind != "llama" and not getattr(model, "takes_layout", False):
                if not info.moe:
                    check_expert_parallel(0, mesh.ep, f"the HF model {cfg.model.name}")  # raises: dense
                raise ValueError("expert parallelism for HF models supports Mixtral (bytescale.models.hf_moe."
                                 "HF_MOE_TYPES) with tp=1 (with tp > 1 an HF model keeps its own experts under "
                                 "its transformers TP plan)")
            model = expert_parallel(model, mesh)
        except ValueError as e:
            raise ConfigError(f"hdp.ep={mesh.ep} with model {cfg.model.name}: {e}") from None
    if mesh.pp > 1:  # this rank's stage of the whole model (initialised alike on every rank)
        try:
            if info.kind == "llama":
                model.pipeline_stage(mesh.stage, mesh.pp)
            elif getattr(model, "takes_layout", False):
                pass  # an HF MoE model, already cut to this rank's stage (_hf_moe)
            else:
                from ..models.hf_stage import hf_pipeline_stage

                if mesh.tp > 1:
                    raise ValueError(f"tensor parallelism (tp={mesh.tp}) inside an HF model's pipeline stage is not "
                                     "wired (its transformers TP plan names the whole model's layers); use tp=1")
                model = hf_pipeline_stage(model, mesh.stage, mesh.pp)
        except ValueError as e:
            raise ConfigError(f"hdp.pp={mesh.pp} with model {cfg.model.name}: {e}") from None
    if mesh.tp > 1:
        from ..models.parallel import hf_tensor_parallel, tensor_parallel

        try:
            if info.kind == "llama":
                tensor_parallel(model, mesh["tp"], sequence_parallel=cfg.hdp.sequence_parallel)
            else:
                if cfg.hdp.sequence_parallel:
                    raise ValueError("hdp.sequence_parallel applies to bytescale's Llama, not to HF models "
                                     "(their transformers TP plan has none)")
                hf_tensor_parallel(model, mesh["tp"])
        except ValueError as e:
            raise ConfigError(f"hdp.tp={mesh.tp} with model {cfg.model.name}: {e}") from None
    if run.activation_checkpointing:
        if info.kind == "llama" or getattr(model, "takes_layout", False):  # ours, or an HF pipeline stage
            model.activation_checkpointing = True
        else:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if run.compile:
        for b in blocks(model, info):
            b.compile(backend=run.compile_backend, dynamic=True)  # token counts change every micro-batch
    rt = runtime_config(cfg)
    if cfg.hdp.fsdp:
        from torch.distributed.fsdp import fully_shard

        from ..models.expert_parallel import expert_param_groups

        # EP x FSDP2: the experts stay out of FSDP2 (already sharded over the EP group; their
        # gradients are summed over the EDP group by HybridDataParallel), the dense parameters are
        # sharded over "hdp"
        ignored = set(expert_param_groups(model)) or None
        for b in blocks(model, info):
            fully_shard(b, mesh=mesh["hdp"], ignored_params=ignored)
        fully_shard(model, mesh=mesh["hdp"], ignored_params=ignored)
        return HybridDataParallel(model, config=rt), rt
    group = mesh.group("hdp") if mesh.tp > 1 or mesh.pp > 1 else None  # the stage's HDP pool
    return HybridDataParallel(model, process_group=group, config=rt), rt


def build_optimizer(model: nn.Module, cfg: TrainConfig):
    """AdamW (no decay on vectors: norms, biases) and a warm-up + cosine LR schedule."""
    import math

    oc = cfg.optim
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": oc.weight_decay}]
    if other:
        groups.append({"params": other, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps)
    total, warm = cfg.train.steps, oc.warmup_steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total - warm)
        t = min(1.0, (step - warm) / span)
        return oc.min_lr_ratio + (1 - oc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return opt, sched
