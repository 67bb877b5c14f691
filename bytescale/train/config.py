"""The training job's configuration: one :class:`TrainConfig` of frozen sections.

Sources, later ones winning: the defaults below, a TOML or YAML file (``--config FILE``), then
command-line overrides, either ``--section.key=value`` (``--hdp.capacity=2048``) or a flat name:
the aliases in :data:`ALIASES` (``--data``, ``--steps``, ``--checkpoint-dir`` ...) and any field
name that occurs in one section only (``--capacity``, ``--lr``, ``--fsdp``). ``--key value`` works
as well as ``--key=value``; a boolean flag alone means true (``--fsdp``, ``--fsdp=false``).

The ``data`` and ``hdp`` sections derive their options from the library's configs
(:mod:`bytescale.config`: LoaderConfig, PlannerConfig, ParallelConfig, RuntimeConfig; types,
defaults, help, choices and bounds are declared there once); :func:`planner_config`,
:func:`loader_config`, :func:`runtime_config` and :func:`parallel_config` turn a TrainConfig back
into them.

Everything is validated when the config is built: an unknown key names itself (and the nearest
known one), a bad value names the field, the value and what was expected.
"""
from __future__ import annotations

import difflib
import json
import os
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, make_dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import LoaderConfig, ParallelConfig, PlannerConfig, RuntimeConfig

__all__ = ["ConfigError", "TrainConfig", "ModelConfig", "DataConfig", "HDPConfig", "OptimConfig",
           "RunConfig", "CheckpointConfig", "MetricsConfig", "ALIASES", "parse_args", "planner_config",
           "loader_config", "runtime_config", "parallel_config"]


class ConfigError(ValueError):
    """A bad configuration key or value (the message names it)."""


def _f(default: Any, help: str, choices: Optional[Tuple[Any, ...]] = None, min: Optional[float] = None):
    return field(default=default, metadata={"help": help, "choices": choices, "min": min})


@dataclass(frozen=True)
class ModelConfig:
    name: str = _f("tiny", "a preset of bytescale's Llama (tiny, small, base, mixtral-tiny, llama3-1b, "
                           "llama3-8b, llama3-70b) or the path of an HF config.json")
    vocab_size: int = _f(0, "vocabulary size; 0: the data's (the preset's if the data has none)", min=0)
    dtype: str = _f("float32", "parameter dtype", choices=("float32", "float64", "bfloat16"))
    experts: int = _f(-1, "MoE experts per block for a preset (-1: the preset's; 0: dense)", min=-1)
    top_k: int = _f(2, "experts per token (MoE)", min=1)
    router_aux_coef: float = _f(0.01, "coefficient of the MoE router balance loss", min=0.0)
    init_seed: int = _f(0, "seed of the initial weights (the same on every rank)")


def _lib(cls: type, name: str, rename: Optional[str] = None, default: Any = MISSING, type_: Any = None,
         help: Optional[str] = None, min: Any = MISSING):
    """A train option copied from a library config field (bytescale/config.py): its type, default,
    help, choices and bound, each overridable where the command line needs another."""
    f = {x.name: x for x in fields(cls)}[name]
    meta = dict(f.metadata)
    if help is not None:
        meta["help"] = help
    if min is not MISSING:
        meta["min"] = min
    d = f.default if default is MISSING else default
    if d is MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no default; give the train option one")
    return (rename or name, type_ or f.type, field(default=d, metadata=meta))


def _section(name: str, doc: str, *specs) -> type:
    cls = make_dataclass(name, list(specs), frozen=True)
    cls.__doc__ = doc
    cls.__module__ = __name__
    return cls


DataConfig = _section(
    "DataConfig", "The data options (the loader's from bytescale.config.LoaderConfig).",
    ("path", "Optional[str]", _f(None, "a token store directory, or synthetic:CORPUS (byted, github) "
                                       "for generated sequences with that length distribution")),
    ("spec", "Optional[str]", _f(None, "a mixing spec file (TOML/YAML/JSON) served by the data service")),
    _lib(LoaderConfig, "tokens_per_batch", default=16384),
    _lib(LoaderConfig, "seed"),
    ("max_length", "int", _f(0, "longer documents are handled as data.oversize says (split: pieces of at most "
                                "this many tokens) "
                                "(0: capacity x HDP units, the longest a plan can hold; a resumed run "
                                "keeps its checkpoint's)", min=0)),
    ("length_scale", "float", _f(1.0, "token store: keep the first ceil(length x scale) tokens of each "
                                      "document (the length distribution at CPU scale)", min=0.0)),
    ("synthetic_docs", "int", _f(4000, "number of sequences of a synthetic corpus", min=1)),
    ("synthetic_scale", "float", _f(1 / 512, "length scale of a synthetic corpus", min=0.0)),
    _lib(LoaderConfig, "prefetch"),
    _lib(LoaderConfig, "oversize"),
    ("workers", "int", _f(1, "source workers per source of the data service (--data-spec)", min=1)),
)

HDPConfig = _section(
    "HDPConfig", "The HDP, mesh and runtime options (from bytescale.config's PlannerConfig, ParallelConfig and "
                 "RuntimeConfig).",
    _lib(PlannerConfig, "capacity", default=1024),
    _lib(PlannerConfig, "strategy"),
    _lib(PlannerConfig, "static_cp", default=0, type_="int", min=0,
         help="CP degree of the static baseline (0: sized for the longest document)"),
    _lib(PlannerConfig, "offload"),
    _lib(PlannerConfig, "peer_budget"),
    _lib(ParallelConfig, "fsdp"),
    _lib(ParallelConfig, "tp"),
    _lib(ParallelConfig, "ep"),
    _lib(ParallelConfig, "pp"),
    _lib(ParallelConfig, "sequence_parallel"),
    _lib(RuntimeConfig, "bf16_grad_comm"),
    _lib(PlannerConfig, "cost", rename="cost_profile", type_="Optional[str]",
         help="planner cost model (a JSON profile from bytescale.profile)"),
    _lib(RuntimeConfig, "bucket_cap_mb"),
)


def planner_config(cfg: "TrainConfig", capacity: Optional[int] = None,
                   static_cp: Optional[int] = None) -> PlannerConfig:
    """The run's :class:`~bytescale.config.PlannerConfig` (``capacity``: a resumed run's raised one)."""
    h = cfg.hdp
    return PlannerConfig(capacity or h.capacity, strategy=h.strategy, offload=h.offload, cost=h.cost_profile,
                         static_cp=static_cp or None, pp=h.pp, peer_budget=h.peer_budget)


def loader_config(cfg: "TrainConfig") -> LoaderConfig:
    d = cfg.data
    return LoaderConfig(d.tokens_per_batch, seed=d.seed, max_steps=cfg.train.stop_after or cfg.train.steps,
                        prefetch=d.prefetch, oversize=d.oversize)


def runtime_config(cfg: "TrainConfig") -> RuntimeConfig:
    return RuntimeConfig(bucket_cap_mb=cfg.hdp.bucket_cap_mb, bf16_grad_comm=cfg.hdp.bf16_grad_comm)


def parallel_config(cfg: "TrainConfig") -> ParallelConfig:
    return ParallelConfig(tp=cfg.hdp.tp, sequence_parallel=cfg.hdp.sequence_parallel, fsdp=cfg.hdp.fsdp,
                          ep=cfg.hdp.ep, pp=cfg.hdp.pp)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = _f(3e-3, "peak learning rate", min=0.0)
    min_lr_ratio: float = _f(0.1, "final learning rate of the cosine decay, as a fraction of lr", min=0.0)
    warmup_steps: int = _f(10, "linear warm-up steps", min=0)
    weight_decay: float = _f(0.1, "AdamW weight decay", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1", min=0.0)
    beta2: float = _f(0.95, "AdamW beta2", min=0.0)
    eps: float = _f(1e-8, "AdamW epsilon", min=0.0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: off)", min=0.0)


@dataclass(frozen=True)
class RunConfig:
    steps: int = _f(100, "total training steps: the LR schedule's length (a resumed run continues up to this)", min=1)
    stop_after: int = _f(0, "stop after this step of the schedule (0: at train.steps), saving a checkpoint "
                            "if checkpoint.dir is set", min=0)
    device: str = _f("auto", "cpu, cuda or auto (cuda when available)", choices=("auto", "cpu", "cuda"))
    bf16: bool = _f(False, "bf16 autocast (mixed precision; parameters and gradients stay in model.dtype)")
    activation_checkpointing: bool = _f(False, "recompute each block in backward")
    compile: bool = _f(False, "torch.compile each block")
    compile_backend: str = _f("inductor", "torch.compile backend")
    peak_tflops: float = _f(0.0, "peak TFLOP/s of one device for the MFU estimate (0: H100/H200 989, "
                                 "A100 312 in bf16; 0.1 per CPU process)", min=0.0)
    log_every: int = _f(1, "print a line every this many steps", min=1)
    progress: bool = _f(True, "tqdm progress bar on rank 0")
    name: str = _f("", "run name in logs (default: HDP, or static DPxCP for the baseline)")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Optional[str] = _f(None, "checkpoint directory (none: no checkpoints)")
    save_every: int = _f(0, "save every this many steps (0: only at the end)", min=0)
    resume: bool = _f(False, "continue from the newest complete checkpoint in dir")
    resume_from: Optional[str] = _f(None, "continue from this checkpoint directory (saves go to dir)")
    keep: int = _f(3, "complete checkpoints to keep (0: all)", min=0)
    async_save: bool = _f(True, "write checkpoints in the background (torch.distributed.checkpoint.async_save)")


@dataclass(frozen=True)
class MetricsConfig:
    path: Optional[str] = _f(None, "metrics JSONL, one line per step (rank 0)")
    samples_log: Optional[str] = _f(None, "JSONL of each step's global batch: {step, samples} (rank 0)")
    tensorboard: Optional[str] = _f(None, "TensorBoard log directory (default: next to --metrics "
                                          "when tensorboard is installed)")
    plot: Optional[str] = _f(None, "PNG of loss and throughput over steps at the end (default: "
                                   "--metrics with .png)")


SECTIONS: Dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "hdp": HDPConfig, "optim": OptimConfig, "train": RunConfig,
    "checkpoint": CheckpointConfig, "metrics": MetricsConfig,
}

ALIASES: Dict[str, str] = {
    "model": "model.name", "data": "data.path", "data_spec": "data.spec", "steps": "train.steps",
    "checkpoint_dir": "checkpoint.dir", "save_every": "checkpoint.save_every", "resume": "checkpoint.resume",
    "samples_log": "metrics.samples_log", "metrics": "metrics.path", "tensorboard": "metrics.tensorboard",
    "plot": "metrics.plot", "keep": "checkpoint.keep", "seed": "data.seed", "run_name": "train.name",
}


def _flat_names() -> Dict[str, str]:
    counts: Dict[str, List[str]] = {}
    for sec, cls in SECTIONS.items():
        for f in fields(cls):
            counts.setdefault(f.name, []).append(f"{sec}.{f.name}")
    out = {k: v[0] for k, v in counts.items() if len(v) == 1}
    out.update(ALIASES)
    return out


FLAT = _flat_names()


@dataclass(frozen=True)
class TrainConfig:
    """Every option of ``python -m bytescale.train`` (see the module docstring for the sources)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hdp: HDPConfig = field(default_factory=HDPConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for sec, cls in SECTIONS.items():
            obj = getattr(self, sec)
            for f in fields(cls):
                _check(f"{sec}.{f.name}", f, getattr(obj, f.name))
        if self.data.path and self.data.spec:
            raise ConfigError("data.path (--data) and data.spec (--data-spec) exclude each other; give one")
        if self.checkpoint.resume and not self.checkpoint.dir:
            raise ConfigError("checkpoint.resume (--resume) needs checkpoint.dir (--checkpoint-dir)")
        if self.checkpoint.save_every and not self.checkpoint.dir:
            raise ConfigError("checkpoint.save_every (--save-every) needs checkpoint.dir (--checkpoint-dir)")
        if self.hdp.static_cp and self.hdp.strategy != "static":
            raise ConfigError(f"hdp.static_cp={self.hdp.static_cp} applies to hdp.strategy=static only "
                              f"(strategy is {self.hdp.strategy!r})")
        try:  # sizes and combinations: bytescale/parallel_dims.py, the one compatibility matrix
            parallel_config(self)
        except ValueError as e:
            raise ConfigError(f"hdp: {str(e).replace('ParallelConfig: ', '')} (options --pp, --tp, --ep, --fsdp, "
                              "--sequence-parallel)") from None
        try:  # the planner's own checks (peer budget, strategy, ...), as the loader will make it
            planner_config(self)
        except ValueError as e:
            raise ConfigError(f"hdp: {e}") from None
        if self.hdp.offload and self.hdp.strategy == "static":
            raise ConfigError("hdp.offload (--offload) does not apply to hdp.strategy=static (the DP x CP "
                              "baseline does not offload)")
        if self.train.stop_after > self.train.steps:
            raise ConfigError(f"train.stop_after {self.train.stop_after} is beyond train.steps {self.train.steps}")
        if not 0 < self.data.length_scale <= 1:
            raise ConfigError(f"data.length_scale must be in (0, 1], got {self.data.length_scale}")
        if self.optim.min_lr_ratio > 1:
            raise ConfigError(f"optim.min_lr_ratio must be <= 1, got {self.optim.min_lr_ratio}")

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "config") -> "TrainConfig":
        """Nested ``{section: {key: value}}`` (as read from TOML/YAML), validated."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where}: expected a table of sections, got {type(d).__name__}")
        kw = {}
        for sec, body in d.items():
            if sec not in SECTIONS:
                raise ConfigError(f"{where}: unknown section {sec!r}{_nearest(sec, SECTIONS)}; sections: "
                                  f"{', '.join(SECTIONS)}")
            if not isinstance(body, Mapping):
                raise ConfigError(f"{where}: section {sec!r} must be a table, got {body!r}")
            names = {f.name: f for f in fields(SECTIONS[sec])}
            vals = {}
            for k, v in body.items():
                k2 = str(k).replace("-", "_")
                if k2 not in names:
                    raise ConfigError(f"{where}: unknown key {sec}.{k}{_nearest(k2, names, sec + '.')}")
                vals[k2] = _coerce(f"{sec}.{k2}", names[k2], v, from_text=False)
            kw[sec] = SECTIONS[sec](**vals)
        return cls(**kw)

    @classmethod
    def load(cls, path: str) -> "TrainConfig":
        """A TOML (``.toml``) or YAML (``.yaml``/``.yml``) file, or JSON (``.json``)."""
        return cls.from_dict(read_file(path), where=str(path))

    def override(self, updates: Mapping[str, Any], from_text: bool = True) -> "TrainConfig":
        """A copy with ``{"section.key" or flat name: value}`` applied (strings parsed when ``from_text``)."""
        secs = {s: {} for s in SECTIONS}
        for key, value in updates.items():
            sec, name, f = resolve_key(key)
            secs[sec][name] = _coerce(f"{sec}.{name}", f, value, from_text)
        kw = {s: replace(getattr(self, s), **v) for s, v in secs.items() if v}
        return replace(self, **kw)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def read_file(path: str) -> Dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(p.read_text())
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(p.read_text()) or {}
        if suffix == ".json":
            return json.loads(p.read_text())
    except Exception as e:  # a syntax error: name the file and the parser's message
        raise ConfigError(f"config file {path}: cannot parse: {e}") from None
    raise ConfigError(f"config file {path}: unknown format {suffix!r} (use .toml, .yaml, .yml or .json)")


def resolve_key(key: str) -> Tuple[str, str, Any]:
    """``"hdp.capacity"``, ``"hdp-capacity"`` style or flat ``"capacity"`` -> (section, name, field)."""
    k = key.lstrip("-").replace("-", "_")
    if "." in k:
        sec, name = k.split(".", 1)
        if sec not in SECTIONS:
            raise ConfigError(f"unknown option {key!r}: no section {sec!r}{_nearest(sec, SECTIONS)}")
    elif k in FLAT:
        sec, name = FLAT[k].split(".")
    elif [sec for sec, cls in SECTIONS.items() if k in {f.name for f in fields(cls)}]:
        where = [f"--{sec}.{k}" for sec, cls in SECTIONS.items() if k in {f.name for f in fields(cls)}]
        raise ConfigError(f"ambiguous option {key!r}: say {' or '.join(where)}")
    else:
        raise ConfigError(f"unknown option {key!r}{_nearest(k, FLAT, '--', dash=True)}")
    names = {f.name: f for f in fields(SECTIONS[sec])}
    if name not in names:
        raise ConfigError(f"unknown option {key!r}: section {sec!r} has no key {name!r}"
                          f"{_nearest(name, names, sec + '.')}")
    return sec, name, names[name]


def _nearest(word: str, options, prefix: str = "", dash: bool = False) -> str:
    m = difflib.get_close_matches(word, list(options), n=1)
    if not m:
        return ""
    return f" (did you mean {prefix}{m[0].replace('_', '-') if dash else m[0]}?)"


def _base_type(tp: Any) -> Tuple[Any, bool]:
    """(type, optional) of a field annotation (strings under ``from __future__ import annotations``)."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # noqa: S307 - our own annotations only
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, f, value: Any, from_text: bool) -> Any:
    tp, optional = _base_type(f.type)
    if value is None or (from_text and optional and isinstance(value, str) and value.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required ({tp.__name__})")
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            if isinstance(value, str):
                return int(value.replace("_", ""), 0)
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, os.PathLike)) and not from_text:
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"{name}: expected {'a boolean' if tp is bool else 'an ' + tp.__name__ if tp is int else 'a ' + tp.__name__}, "
                      f"got {value!r}")


def _check(name: str, f, value: Any) -> None:
    meta = f.metadata
    tp, optional = _base_type(f.type)
    if value is None:
        if not optional:
            raise ConfigError(f"{name}: a value is required")
        return
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(str, meta['choices']))}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{name}: must be >= {meta['min']}, got {value!r}")


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """``[--config FILE] [--section.key=value | --flat-name value | --bool-flag] ...`` -> TrainConfig.

    ``--help`` prints every option and raises SystemExit(0).
    """
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    config_file = None
    updates: Dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-h", "--help"):
            print(help_text())
            raise SystemExit(0)
        if not a.startswith("--"):
            raise ConfigError(f"unexpected argument {a!r} (options look like --section.key=value)")
        if "=" in a:
            key, value = a[2:].split("=", 1)
            i += 1
        else:
            key = a[2:]
            if key == "config":
                if i + 1 >= len(args):
                    raise ConfigError("--config needs a file")
                config_file, i = args[i + 1], i + 2
                continue
            sec, name, f = resolve_key(key)
            is_bool = _base_type(f.type)[0] is bool
            nxt = args[i + 1] if i + 1 < len(args) else None
            if is_bool and (nxt is None or nxt.startswith("--") or nxt.lower() not in _TRUE | _FALSE):
                value, i = "true", i + 1
            elif nxt is None:
                raise ConfigError(f"--{key} needs a value")
            else:
                value, i = nxt, i + 2
        if key == "config":
            config_file = value
            continue
        updates[key] = value
    cfg = TrainConfig.load(config_file) if config_file else TrainConfig()
    return cfg.override(updates)


def help_text() -> str:
    lines = ["usage: python -m bytescale.train [--config FILE.toml|.yaml] [--section.key=value ...]", ""]
    rev = {v: k for k, v in ALIASES.items()}
    for sec, cls in SECTIONS.items():
        lines.append(f"[{sec}]")
        for f in fields(cls):
            full = f"{sec}.{f.name}"
            flat = rev.get(full) or (f.name if FLAT.get(f.name) == full else None)
            alias = f" (--{flat.replace('_', '-')})" if flat else ""
            default = f.default if f.default is not MISSING else None
            lines.append(f"  --{full}{alias}  [{default!r}]  {f.metadata.get('help', '')}")
        lines.append("")
    return "\n".join(lines)
