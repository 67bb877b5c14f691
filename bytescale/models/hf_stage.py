"""One pipeline stage of an HF transformers causal LM (Llama, Mistral, Qwen2, Qwen3, Mixtral).

:func:`hf_pipeline_stage` cuts ``AutoModelForCausalLM`` (built with
``attn_implementation="bytescale"``) into stage ``stage`` of ``stages`` equal stages of its decoder
layers, the way :meth:`bytescale.models.Llama.pipeline_stage` cuts bytescale's Llama, and returns a
module with the stage protocol the step executor runs::

    stage = hf_pipeline_stage(AutoModelForCausalLM.from_config(cfg, attn_implementation="bytescale"), s, P)
    out, aux = stage(input_ids or None, position_ids, layout=layout, global_tokens=n, return_aux=True,
                     hidden=None or the previous stage's (T, stage.hidden_size) output)

The first stage embeds ``input_ids`` (T,); a later stage takes ``hidden`` (T, hidden_size); the
last returns logits (T, V) (final norm, LM head), the others hidden states (T, hidden_size).
``aux`` is a zero (HF's own router balance loss is not part of the unsplit model's training
either: the executor uses its logits only; an HF Mixtral's stage with its balance loss made exact
under HDP is :class:`bytescale.models.hf_moe.HFMoEStage`). Each kept decoder layer runs as the model's own
forward runs it: batch dimension 1, the rotary module's position embeddings for
``position_ids``, attention through ``attn_implementation="bytescale"`` under ``layout`` made the
current micro-batch layout (also in the recomputation of activation checkpointing).

Parameter names stay those of the whole model (``model.layers.5.self_attn.q_proj.weight``,
``model.embed_tokens.weight``, ``lm_head.weight``), so checkpoints do not depend on the depth.
Tied input and output embeddings across a first and a last stage are refused (their gradient
would have to be summed between two stages): untie them (``tie_word_embeddings=False``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..attention.api import current_layout, micro_batch_context
from ..attention.layout import Layout
from .llama import stage_input

__all__ = ["HFPipelineStage", "hf_pipeline_stage", "VERIFIED_MODEL_TYPES"]

# Model types whose base model's forward is exactly: embed_tokens -> each decoder layer (hidden,
# position_embeddings=rotary_emb(hidden, position_ids)) -> norm, and whose causal LM's head is
# lm_head(hidden) (no embedding scale, no logit soft-capping). Others are refused, not guessed.
VERIFIED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3")


def _err(msg: str) -> ValueError:
    return ValueError(f"hf_pipeline_stage: {msg}")


def _uses_sliding_window(config: Any) -> bool:
    if getattr(config, "sliding_window", None) is None:
        return False
    types = getattr(config, "layer_types", None)
    return types is None or "sliding_attention" in types


def _check_model(model: nn.Module) -> nn.Module:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in VERIFIED_MODEL_TYPES:
        raise _err(f"{type(model).__name__} (model_type {kind!r}) is not one of the verified model types "
                   f"{VERIFIED_MODEL_TYPES}: its forward may do more than embed -> decoder layers -> norm -> head "
                   "(an embedding scale, logit soft-capping), which a stage would silently drop")
    inner = getattr(model, "model", None)
    missing = [n for n in ("layers", "embed_tokens", "norm", "rotary_emb")
               if getattr(inner, n, None) is None]
    if getattr(model, "lm_head", None) is None:
        missing.append("lm_head")
    if missing:
        raise _err(f"{type(model).__name__} is not a whole causal LM (model.model.layers, embed_tokens, norm, "
                   f"rotary_emb and lm_head): missing {missing}; is it already a pipeline stage?")
    if not isinstance(inner.layers, nn.ModuleList):
        raise _err(f"{type(model).__name__}.model.layers is a {type(inner.layers).__name__}, not the model's "
                   "ModuleList of decoder layers; is it already a pipeline stage?")
    impl = getattr(config, "_attn_implementation", None)
    if impl != "bytescale":
        raise _err(f"{type(model).__name__} uses attn_implementation={impl!r}; build it with "
                   "attn_implementation=\"bytescale\" (its attention must read the micro-batch layout)")
    if _uses_sliding_window(config):
        raise _err(f"{type(model).__name__} has sliding-window attention (sliding_window={config.sliding_window}); "
                   "bytescale attention is full causal attention per document: set sliding_window=None "
                   "(or use_sliding_window=False)")
    return inner


class HFPipelineStage(nn.Module):
    """A stage of an HF causal LM (module docstring): ``model`` (the base model with only this
    stage's decoder layers, its embedding on the first stage, its final norm on the last) and
    ``lm_head`` (last stage only). Build it with :func:`hf_pipeline_stage`."""

    takes_layout = True  # forward takes layout= explicitly (the step executor's stage protocol)

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        from ..planner import stage_layers

        inner = _check_model(model)
        n_layers = len(inner.layers)
        try:
            per = stage_layers(n_layers, stages)
        except ValueError as e:
            raise _err(str(e)) from None
        if not 0 <= stage < stages:
            raise _err(f"stage {stage} outside [0, {stages})")
        tied = model.lm_head.weight is inner.embed_tokens.weight
        if stages > 1 and (tied or getattr(model.config, "tie_word_embeddings", False)):
            raise _err(f"{type(model).__name__} ties lm_head to embed_tokens (tie_word_embeddings=True), which would "
                       f"live on stages 0 and {stages - 1}; pipeline stages do not sum a tied weight's gradient "
                       "across stages: build the model with tie_word_embeddings=False")
        first, last = stage == 0, stage == stages - 1
        self.config = model.config
        self.stage, self.stages = int(stage), int(stages)
        self.hidden_size = int(model.config.hidden_size)
        self.activation_checkpointing = False
        self.loss_parallel = False
        # the kept layers keyed by their index in the whole model: "model.layers.5.<...>" at any depth
        kept = nn.ModuleDict({str(i): inner.layers[i] for i in range(stage * per, (stage + 1) * per)})
        inner.layers = kept  # the others' parameters are freed with the ModuleList
        if not first:
            inner.embed_tokens = None
        if not last:
            inner.norm = None
        self.model = inner
        self.lm_head = model.lm_head if last else None
        model.model, model.lm_head = None, None  # the whole model's object no longer holds the stage

    @property
    def layers(self) -> nn.ModuleDict:
        """This stage's decoder layers, keyed by their index in the whole model."""
        return self.model.layers

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                layout: Optional[Layout] = None, *, global_tokens: Optional[int] = None,
                return_aux: bool = False, hidden: Optional[torch.Tensor] = None):
        """``(out, aux)`` with ``return_aux`` else ``out``: logits (T, V) on the last stage, hidden
        states (T, hidden_size) before it. ``global_tokens`` is accepted for the protocol (no
        balance loss here)."""
        inner = self.model
        first = " (the first)" if inner.embed_tokens is not None else ""
        x = stage_input(inner.embed_tokens, input_ids, hidden, self.hidden_size,
                        f"HFPipelineStage {self.stage} of {self.stages}{first}")
        if position_ids is None:
            position_ids = torch.arange(x.shape[0], device=x.device)
        if position_ids.shape != x.shape[:1]:
            raise ValueError(f"HFPipelineStage: position_ids {tuple(position_ids.shape)} do not match the "
                             f"{x.shape[0]} tokens")
        empty = x.shape[0] == 0
        if empty:  # HF layers cannot run 0 tokens: one dummy token whose outputs count 0 (every
            # parameter still gets a zero gradient, and the input hidden its (0, hidden_size) one)
            x = x.new_zeros(1, x.shape[1]) + x.sum()
            position_ids, layout = position_ids.new_zeros(1), Layout.local([1])
        pos = position_ids[None]
        x = x[None]                                   # HF layers take (1, T, hidden)
        pe = inner.rotary_emb(x, pos)                 # (cos, sin), each (1, T, head_dim)
        with _layout_scope(layout):  # one agreement scope for all layers (ring calls checked once)
            for layer in inner.layers.values():
                if self.activation_checkpointing and torch.is_grad_enabled():
                    x = checkpoint(_run_layer, layer, x, pos, pe, layout, use_reentrant=False)
                else:
                    x = _run_layer(layer, x, pos, pe, layout)
        out = x[0] if self.lm_head is None else self.lm_head(inner.norm(x))[0]
        if empty:
            out = out[:0] + out.sum() * 0
        if not return_aux:
            return out
        return out, torch.zeros((), dtype=torch.float32, device=out.device)


def _layout_scope(layout: Optional[Layout]):
    """``layout`` made the current micro-batch layout, unless it already is (the forward's own
    scope, or the caller's: then no new agreement scope, which would check ring calls again).
    Without a layout: the caller's, if any (else one causal document)."""
    if layout is None:
        return contextlib.nullcontext()
    try:
        if current_layout() is layout:
            return contextlib.nullcontext()
    except RuntimeError:  # blocks open on several other threads: this thread's own block decides
        pass
    return micro_batch_context(layout)


def _run_layer(layer: nn.Module, x: torch.Tensor, pos: torch.Tensor, pe, layout: Optional[Layout]) -> torch.Tensor:
    """One decoder layer as the model's forward calls it, under ``layout`` (also when activation
    checkpointing recomputes it in backward, outside the forward's scope)."""
    with _layout_scope(layout):
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return out[0] if isinstance(out, tuple) else out


def hf_pipeline_stage(model: nn.Module, stage: int, stages: int) -> HFPipelineStage:
    """Stage ``stage`` of ``stages`` equal stages of the HF causal LM ``model`` (module docstring).

    Call it on the whole model initialised as a single process would (the same seed on every rank).
    ``model`` is taken apart: its other layers are freed and it no longer holds the stage's modules.

    Raises:
        ValueError: the stages do not divide the layers, ``stage`` is outside [0, stages), tied
            embeddings with ``stages`` > 1, sliding-window attention, an attention implementation
            other than ``"bytescale"``, or a model type not in :data:`VERIFIED_MODEL_TYPES`.
    """
    return HFPipelineStage(model, stage, stages)
