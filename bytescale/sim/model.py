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

Tensor parallelism (``tp`` = T > 1, Megatron-style with sequence parallelism): an HDP unit is T GPUs
of one node and the planner plans units. Each GPU runs the unit's micro-batch on its local heads
(``heads / T`` query heads; ``kv_heads / T`` K/V heads, or one replicated K/V head when T exceeds
them) and a 1/T slice of the MLP, the output projection and the LM head (the K/V projections of a
replicated head are computed on every GPU that holds it). Per GPU and layer:

* ``a1 / T`` and ``b1`` from the GPU's own matmul parameters (:func:`gpu_layer_params`);
* TP collectives (:func:`tp_comm_time`): all-gather and reduce-scatter of the layer's input around
  attention and MLP, forward and backward: 8 collectives of ``tokens x hidden x 2`` bytes, each
  moving ``(T-1)/T`` of them over NVLink plus ``T-1`` latencies; NOT overlapped with compute
  (conservative, as the gradient sync);
* activations ``34 x hidden / T`` bytes per token (sequence parallelism shards the whole layer's
  activations, Korthikanti et al.) plus the replicated K/V heads' extra; K/V ring traffic of its
  local K/V heads only (a ring of d units runs once per TP index, the T rings in parallel on the
  GPUs' own links).

Pipeline parallelism (``pp`` = P > 1, 1F1B): the layers are cut into P equal stages (P must divide
them, :func:`check_pp`); an HDP unit of a stage holds ``layers / P`` layers, the cost model is one
stage's (``layers / P``; the LM head's work spread over the layers as above, so the stages are
uniform), a GPU stores ``1/P`` of the layers plus the embedding (or the LM head, on the last stage);
1F1B keeps up to P micro-batches in flight on the first stage, so a micro-batch's activations take
``P x layers / P = layers`` layers' worth of memory per token (the capacity of a unit is what fits
that). Between stages a micro-batch's activations (and their gradients, backward) move as
``hidden x 2 / tp`` bytes per token per GPU (bf16, sequence-parallel shards) over the inter-node
link when a stage spans at least a node, NVLink otherwise (:func:`p2p_terms`).

``efficiency`` (default 0.4, i.e. ~400 TFLOP/s attained on an H100, the figure the planner's
default cost model assumes) is a stated assumption, the same for every strategy. A measured profile
(``bytescale.profile`` JSON) replaces a1, b1, g, a2, b2 and layers: :func:`cost_model`.

Presets: the ByteScale paper's Table 1 shapes (every model with 8 K/V groups, GQA): llama-7b
(32 layers, 32 heads, hidden 4096), llama-13b (40/40/5120), llama-30b (60/56/6656), llama-70b
(80/64/8192), mistral-8x7b (32/32/4096, 8 experts, top 2), mistral-8x22b (56/48/6144, top 2); FFN
sizes and vocabularies of the published configs; head size 128 throughout (llama-30b's 6656 /
56 is not an integer: its query width is 56 x 128 = 7168). Also bytescale's own Llama presets
(``tiny`` ... as ``bytescale.models.presets``), or any HF ``config.json`` path.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .cluster import ClusterSpec

__all__ = ["ModelShape", "MODELS", "model_shape", "cost_model", "default_capacity", "DEFAULT_EFFICIENCY",
           "LAYER_OVERHEAD_S", "check_tp", "local_heads", "gpu_layer_params", "gpu_params", "act_bytes_per_token",
           "tp_comm_time", "planner_cost", "check_pp", "p2p_terms", "FWD_SHARE"]

FWD_SHARE = 1.0 / 3.0  # the forward's share of a micro-batch's forward + backward time

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


MODELS: Dict[str, ModelShape] = {  # the paper's Table 1 (module docstring)
    "llama-7b": ModelShape("llama-7b", 32, 4096, 32, 8, 128, 11008, 32000),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 8, 128, 13824, 32000),
    "llama-30b": ModelShape("llama-30b", 60, 6656, 56, 8, 128, 17920, 32000),
    "llama-70b": ModelShape("llama-70b", 80, 8192, 64, 8, 128, 28672, 32000),
    "mistral-8x7b": ModelShape("mistral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, experts=8, top_k=2),
    "mistral-8x22b": ModelShape("mistral-8x22b", 56, 6144, 48, 8, 128, 16384, 32768, experts=8, top_k=2),
}


# ---- tensor parallelism (module docstring) -----------------------------------------------------

def check_tp(shape: ModelShape, cl: ClusterSpec, tp: int) -> None:
    """Raises ValueError naming the values when ``tp`` GPUs cannot form an HDP unit of ``shape`` on
    ``cl``: tp < 1, a unit that does not fit or divide a node, a cluster that is not whole units,
    query heads not divisible by tp, K/V heads that tp neither divides nor is a multiple of."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    if cl.gpus_per_node % tp:
        raise ValueError(f"tp {tp} does not divide gpus_per_node {cl.gpus_per_node} (a TP group must sit "
                         "inside one node, on NVLink)")
    if cl.gpus % tp:
        raise ValueError(f"tp {tp} does not divide the cluster's {cl.gpus} GPUs")
    if shape.heads % tp:
        raise ValueError(f"model {shape.name}: tp {tp} does not divide its {shape.heads} attention heads")
    if shape.kv_heads % tp and tp % shape.kv_heads:
        raise ValueError(f"model {shape.name}: tp {tp} neither divides its {shape.kv_heads} K/V heads nor is a "
                         "multiple of them (K/V heads are split, or replicated when tp exceeds them)")


def local_heads(shape: ModelShape, tp: int) -> Tuple[int, int]:
    """(query heads, K/V heads) on one GPU of a TP group of ``tp`` (K/V replicated past kv_heads)."""
    return shape.heads // tp, max(1, shape.kv_heads // tp)


def gpu_layer_params(shape: ModelShape, tp: int = 1) -> float:
    """Matmul parameters one token multiplies with in one layer on ONE GPU of a TP group (the
    ``active_layer_params`` at tp = 1): Q and output projections and the MLP split ``tp`` ways,
    the K/V projections of the GPU's local (possibly replicated) K/V heads."""
    if tp == 1:
        return float(shape.active_layer_params)
    _, kv = local_heads(shape, tp)
    mlp = 3 * shape.hidden * shape.ffn * (shape.top_k if shape.experts else 1)
    return (2 * shape.hidden * shape.heads * shape.head_dim + mlp) / tp + 2 * shape.hidden * kv * shape.head_dim


def check_pp(shape: ModelShape, cl: ClusterSpec, tp: int, pp: int) -> int:
    """The number of pipelines (HDP units per stage) of ``gpus / (tp x pp)``; ValueError naming the
    values when ``pp`` is not an integer >= 1, does not divide the model's layers (the planner's
    :func:`bytescale.planner.stage_layers`) or the cluster is not whole pipelines."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an integer >= 1, got {pp!r}")
    check_tp(shape, cl, tp)
    from ..planner import stage_layers

    try:
        stage_layers(shape.layers, pp)
    except ValueError as e:
        raise ValueError(f"model {shape.name}: {e}") from None
    if cl.gpus % (tp * pp):
        raise ValueError(f"tp {tp} x pp {pp} = {tp * pp} GPUs per pipeline does not divide the cluster's "
                         f"{cl.gpus} GPUs")
    return cl.gpus // (tp * pp)


def p2p_terms(shape: ModelShape, cl: ClusterSpec, tp: int, pp: int) -> Tuple[float, float, float]:
    """(bytes per token, bytes/s, latency s) of one stage-to-stage transfer on one GPU (module
    docstring): a stage is ``gpus / pp`` GPUs, on NVLink with its neighbour only when that is less
    than a node."""
    bw, lat = cl.link(cl.gpus // pp >= cl.gpus_per_node)
    return 2.0 * shape.hidden / tp, bw, lat


def gpu_params(shape: ModelShape, tp: int = 1, pp: int = 1) -> float:
    """Parameters stored on one GPU of a TP group (``params`` at tp = 1): every matrix split
    ``tp`` ways (embeddings and LM head vocab-parallel), replicated K/V heads' projections whole,
    norms replicated. With ``pp`` stages: the largest stage's, ``layers / pp`` layers plus the
    embedding (the first stage; the last holds the LM head instead)."""
    if pp > 1:
        _, kv = local_heads(shape, tp)
        q_o = 2 * shape.hidden * shape.heads * shape.head_dim
        kv_proj = 2 * shape.hidden * kv * shape.head_dim
        mlp = 3 * shape.hidden * shape.ffn * max(1, shape.experts) + shape.hidden * shape.experts
        layer = (q_o + mlp) / tp + kv_proj + 2 * shape.hidden
        return shape.layers // pp * layer + shape.vocab * shape.hidden / tp + shape.hidden
    if tp == 1:
        return float(shape.params)
    _, kv = local_heads(shape, tp)
    q_o = 2 * shape.hidden * shape.heads * shape.head_dim
    kv_proj = 2 * shape.hidden * kv * shape.head_dim
    mlp = 3 * shape.hidden * shape.ffn * max(1, shape.experts) + shape.hidden * shape.experts
    emb = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)
    return shape.layers * ((q_o + mlp) / tp + kv_proj + 2 * shape.hidden) + emb / tp + shape.hidden


def act_bytes_per_token(shape: ModelShape, tp: int = 1) -> float:
    """Activation bytes one GPU keeps per token of its unit's micro-batch per layer:
    ``34 x hidden / tp`` (sequence parallelism) plus the K/V of replicated K/V heads (bf16)."""
    if tp == 1:
        return ACT_BYTES_PER_HIDDEN * shape.hidden
    _, kv = local_heads(shape, tp)
    return ACT_BYTES_PER_HIDDEN * shape.hidden / tp + 4.0 * shape.head_dim * (kv - shape.kv_heads / tp)


def tp_comm_time(shape: ModelShape, cl: ClusterSpec, tp: int) -> Tuple[float, float]:
    """TP collectives of one layer, forward and backward, on one GPU: (seconds per token, seconds
    per micro-batch). 8 all-gathers / reduce-scatters of ``hidden x 2`` bytes per token over
    NVLink, each moving (tp-1)/tp of the data plus tp-1 hop latencies; (0, 0) at tp = 1."""
    if tp == 1:
        return 0.0, 0.0
    per_token = 8.0 * (tp - 1) / tp * shape.hidden * 2.0 / cl.intra_bw
    return per_token, 8.0 * (tp - 1) * cl.intra_latency


def planner_cost(cm: Any, shape: ModelShape, cl: ClusterSpec, tp: int) -> Any:
    """The cost model the PLANNER plans units with: ``cm`` (one unit's compute) plus the TP
    collectives (:func:`tp_comm_time`) folded into b1 and g; ``cm`` itself at tp = 1."""
    if tp == 1:
        return cm
    from ..planner import CostModel

    per_token, per_call = tp_comm_time(shape, cl, tp)
    out = CostModel.from_json(cm.to_json())
    out.b1 = cm.b1 + per_token
    out.g = cm.g + per_call
    out.validate()
    return out


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
               profile: Optional[str] = None, tp: int = 1, pp: int = 1) -> Any:
    """The :class:`bytescale.planner.CostModel` of one HDP unit's compute for ``shape`` on ``cl``
    (one GPU at ``tp`` = 1; per GPU of a TP group of ``tp`` otherwise: its local heads and slices,
    its activation bytes and K/V ring traffic; the TP collectives are priced apart, see
    :func:`planner_cost`).

    ``pp`` > 1: one pipeline stage's (``layers / pp`` layers, :func:`check_pp`).

    Without ``profile``: derived from FLOPs at ``efficiency`` (module docstring). With ``profile``
    (a JSON written by ``bytescale.profile``, or ``"default"`` for the planner's built-in
    LLaMA-7B/H100 model): its a1, b1, g, a2, b2, layers and host bandwidths (one device, so tp = 1
    only). Either way the ring bandwidth/latency the PLANNER assumes is the cluster's slowest ring
    link (inter-node when the cluster has more than one node); the simulator itself prices each
    ring by its own link.
    """
    from ..planner import CostModel, load_cost_model

    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    check_tp(shape, cl, tp)
    if pp != 1:
        check_pp(shape, cl, tp, pp)
    if profile is not None and pp > 1:
        raise ValueError(f"a cost profile ({profile!r}) measures a whole model on one device; pp {pp} needs "
                         "the FLOP-derived cost model (leave out the profile)")
    if profile is not None and tp > 1:
        raise ValueError(f"a cost profile ({profile!r}) measures one device without tensor parallelism; "
                         f"tp {tp} needs the FLOP-derived cost model (leave out the profile)")
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
        cm.a1 = 6.0 * shape.heads * shape.head_dim / rate / tp
        cm.b1 = 6.0 * (gpu_layer_params(shape, tp) + shape.vocab * shape.hidden / shape.layers / tp) / rate
        cm.g = LAYER_OVERHEAD_S
        cm.a2 = act_bytes_per_token(shape, tp)
        cm.b2 = 0.0
        cm.layers = shape.layers // pp
        cm.bw_d2h = cm.bw_h2d = cl.host_bw
    bw, lat = cl.link(cl.gpus > cl.gpus_per_node)
    cm.ring_bw = bw
    cm.ring_latency = lat
    if profile is None or profile != "default":
        cm.kv_bytes_per_token = (shape.kv_bytes_per_token if tp == 1
                                 else 2.0 * local_heads(shape, tp)[1] * shape.head_dim * 2.0)
    cm.validate()
    return cm


def default_capacity(shape: ModelShape, cl: ClusterSpec, cm: Any, tp: int = 1, pp: int = 1) -> int:
    """Tokens per micro-batch per HDP unit (one device at ``tp`` = 1, else ``tp`` devices holding a
    1/tp share of its activations, ``cm.a2`` being per device) that fit in memory, rounded down to
    a power of two.

    Model states per device (its TP shard, :func:`gpu_params`): bf16 weights and gradients
    replicated over the HDP units, fp32 master weights and Adam moments (12 bytes/param) sharded
    over them (ZeRO-1); if the replicated part exceeds 40% of the device, everything is sharded
    (FSDP) and two layers' weights are gathered at a time. 90% of the device is usable; the rest
    holds activations at ``layers x Act(1)`` bytes per token. With ``pp`` stages (``cm`` one stage's):
    the largest stage's states, sharded over the stage's units, and ``pp`` micro-batches of
    ``layers / pp`` layers in flight (1F1B's first stage), i.e. the same ``layers x Act(1)``.
    """
    units = check_pp(shape, cl, tp, pp)
    p = gpu_params(shape, tp, pp)
    replicated = 4.0 * p
    if replicated > 0.4 * cl.gpu_memory:
        states = 16.0 * p / units + 2 * 4.0 * p / (shape.layers // pp)
    else:
        states = replicated + 12.0 * p / units
    free = 0.9 * cl.gpu_memory - states
    per_token = cm.layers * pp * cm.act(1.0)
    tokens = int(free // per_token) if free > 0 else 0
    if tokens < 1:
        raise ValueError(f"model {shape.name}: no activation memory left on a {cl.gpu_memory / 1e9:.0f} GB "
                         "device (give --capacity)")
    cap = 1
    while cap * 2 <= tokens:
        cap *= 2
    return cap
