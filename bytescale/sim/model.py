"""Model shapes and the per-layer cost model the simulator derives from them.

A :class:`ModelShape` is what a transformer's cost depends on: layers, hidden size, attention heads
(query and key/value), head dimension, FFN size, vocabulary and experts. From it and a
:class:`~bytescale.sim.cluster.ClusterSpec` the simulator derives the planner's per-layer cost model
(``T(s) = a1 s^2 + b1 s + g`` seconds, ``Act(s) = a2 s`` bytes, csrc/planner/cost_model.h):

* ``b1 = 6 x (matmul parameters a token uses in one layer + the LM head's share per layer) /
  (peak x efficiency)``: forward + backward of the linear layers (2 + 4 FLOP per parameter);
* ``a1 = 6 x heads x head_dim / (peak x efficiency)``: causal attention, forward 2 s^2 h d (QK^T and
  PV, half of the square), backward twice that;
* ``g = 1e-4`` s per layer and micro-batch: fixed kernel-launch overhead (the planner's default);
* ``a2 = 34 x hidden`` bytes per token per layer (Korthikanti et al. 2022, bf16, the attention-score
  term removed by flash attention);
* K/V bytes per token: ``2 x kv_heads x head_dim x 2`` (bf16).

``efficiency`` (default 0.4, i.e. ~400 TFLOP/s attained on an H100, the figure the planner's
default cost model assumes) is a stated assumption, the same for every strategy. A measured profile
(``bytescale.profile`` JSON) replaces a1, b1, g, a2, b2 and layers: :func:`cost_model`.

Presets: llama-7b, llama-13b, llama-30b, llama-70b, mistral-8x7b (published configs), bytescale's
own Llama presets (``tiny`` ... as ``bytescale.models.presets``), or any HF ``config.json`` path.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .cluster import ClusterSpec

__all__ = ["ModelShape", "MODELS", "model_shape", "cost_model", "default_capacity", "DEFAULT_EFFICIENCY",
           "LAYER_OVERHEAD_S"]

DEFAULT_EFFICIENCY = 0.4
LAYER_OVERHEAD_S = 1e-4
ACT_BYTES_PER_HIDDEN = 34.0


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (MoE when ``experts > 0``)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    top_k: int = 1
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name!r}: {f} must be an integer >= 1, got {v!r}")

    @property
    def attn_params(self) -> int:
        """Q, K, V and output projections of one layer."""
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        """One layer's (gated) MLP; all experts for an MoE."""
        return 3 * self.hidden * self.ffn * max(1, self.experts) + self.hidden * self.experts

    @property
    def active_layer_params(self) -> int:
        """Matmul parameters one token multiplies with in one layer (top_k experts for an MoE)."""
        mlp = 3 * self.hidden * self.ffn * (self.top_k if self.experts else 1)
        return self.attn_params + mlp

    @property
    def params(self) -> int:
        """Total parameters (embeddings and norms included)."""
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (self.attn_params + self.mlp_params + 2 * self.hidden) + emb + self.hidden

    @property
    def matmul_params_per_token(self) -> int:
        """Parameters one token multiplies with in the whole model (the LM head included)."""
        return self.layers * self.active_layer_params + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token in one layer, bf16."""
        return 2.0 * self.kv_heads * self.head_dim * 2.0

    def flops(self, tokens: float, sum_sq: float) -> float:
        """Model FLOPs (forward + backward) of documents with ``tokens`` tokens in all and
        ``sum_sq`` = sum of squared lengths: 6 x matmul params x tokens + causal attention
        6 x layers x heads x head_dim x sum of L^2 (as ``bytescale.train.metrics.FlopsModel``)."""
        return 6.0 * self.matmul_params_per_token * tokens + 6.0 * self.layers * self.heads * self.head_dim * sum_sq


MODELS: Dict[str, ModelShape] = {
    "llama-7b": ModelShape("llama-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    "llama-30b": ModelShape("llama-30b", 60, 6656, 52, 52, 128, 17920, 32000),
    "llama-70b": ModelShape("llama-70b", 80, 8192, 64, 8, 128, 28672, 32000),
    "mistral-8x7b": ModelShape("mistral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, experts=8, top_k=2),
}


def _from_hf(path: str) -> ModelShape:
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model config {path}: cannot read it as JSON ({e})") from None
    try:
        hidden = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        return ModelShape(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
            layers=int(c["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads), ffn=int(c["intermediate_size"]),
            vocab=int(c["vocab_size"]), experts=int(c.get("num_local_experts") or 0),
            top_k=int(c.get("num_experts_per_tok") or 1),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"model config {path}: missing key {e.args[0]!r} (an HF decoder config.json "
                         "needs hidden_size, num_attention_heads, num_hidden_layers, intermediate_size, "
                         "vocab_size)") from None


def _from_bytescale_preset(name: str) -> Optional[ModelShape]:
    from ..models.presets import PRESETS

    cfg = PRESETS.get(name)
    if cfg is None:
        return None
    hd = cfg.dim // cfg.n_heads
    return ModelShape(name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, hd, cfg.ffn_dim,
                      cfg.vocab_size, experts=int(getattr(cfg, "n_experts", 0) or 0),
                      top_k=int(getattr(cfg, "top_k", 1) or 1))


def model_shape(name: str) -> ModelShape:
    """A preset (:data:`MODELS` or bytescale's own ``tiny``/``small``/... presets) or an HF
    ``config.json`` path. Raises ValueError naming an unknown model."""
    if name in MODELS:
        return MODELS[name]
    if name.endswith(".json") or os.path.isfile(name):
        if not os.path.isfile(name):
            raise ValueError(f"model config {name!r} does not exist")
        return _from_hf(name)
    shape = _from_bytescale_preset(name)
    if shape is None:
        from ..models.presets import PRESETS

        raise ValueError(f"unknown model {name!r}; presets: {', '.join(list(MODELS) + list(PRESETS))} "
                         "(or the path of an HF config.json)")
    return shape


def cost_model(shape: ModelShape, cl: ClusterSpec, efficiency: float = DEFAULT_EFFICIENCY,
               profile: Optional[str] = None) -> Any:
    """The planner's :class:`bytescale.planner.CostModel` for ``shape`` on ``cl``.

    Without ``profile``: derived from FLOPs at ``efficiency`` (module docstring). With ``profile``
    (a JSON written by ``bytescale.profile``, or ``"default"`` for the planner's built-in
    LLaMA-7B/H100 model): its a1, b1, g, a2, b2, layers and host bandwidths. Either way the ring
    bandwidth/latency the PLANNER assumes is the cluster's slowest ring link (inter-node when the
    cluster has more than one node); the simulator itself prices each ring by its own link.
    """
    from ..planner import CostModel, load_cost_model

    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    if profile is not None:
        if profile == "default":
            cm = CostModel()
        elif not os.path.isfile(profile):
            raise ValueError(f"profile {profile!r}: no such file (a JSON from bytescale.profile, or 'default')")
        else:
            cm = load_cost_model(profile)
    else:
        rate = cl.peak_flops * efficiency / cl.compute_slowdown
        cm = CostModel()
        cm.a1 = 6.0 * shape.heads * shape.head_dim / rate
        cm.b1 = 6.0 * (shape.active_layer_params + shape.vocab * shape.hidden / shape.layers) / rate
        cm.g = LAYER_OVERHEAD_S
        cm.a2 = ACT_BYTES_PER_HIDDEN * shape.hidden
        cm.b2 = 0.0
        cm.layers = shape.layers
        cm.bw_d2h = cm.bw_h2d = cl.host_bw
    bw, lat = cl.link(cl.gpus > cl.gpus_per_node)
    cm.ring_bw = bw
    cm.ring_latency = lat
    if profile is None or profile != "default":
        cm.kv_bytes_per_token = shape.kv_bytes_per_token
    cm.validate()
    return cm


def default_capacity(shape: ModelShape, cl: ClusterSpec, cm: Any) -> int:
    """Tokens per micro-batch per device that fit in memory, rounded down to a power of two.

    Model states: bf16 weights and gradients replicated, fp32 master weights and Adam moments
    (12 bytes/param) sharded over all devices (ZeRO-1); if the replicated part exceeds 40% of the
    device, everything is sharded (FSDP) and two layers' weights are gathered at a time. 90% of the
    device is usable; the rest holds activations at ``layers x Act(1)`` bytes per token.
    """
    p = float(shape.params)
    replicated = 4.0 * p
    if replicated > 0.4 * cl.gpu_memory:
        states = 16.0 * p / cl.gpus + 2 * 4.0 * p / shape.layers
    else:
        states = replicated + 12.0 * p / cl.gpus
    free = 0.9 * cl.gpu_memory - states
    per_token = cm.layers * cm.act(1.0)
    tokens = int(free // per_token) if free > 0 else 0
    if tokens < 1:
        raise ValueError(f"model {shape.name}: no activation memory left on a {cl.gpu_memory / 1e9:.0f} GB "
                         "device (give --capacity)")
    cap = 1
    while cap * 2 <= tokens:
        cap *= 2
    return cap
