"""Reference models that train under bytescale (packed varlen input, bytescale attention):
a Llama (optionally a Mixtral-style MoE) and named sizes of it; HF models via :mod:`.hf`, cut into
pipeline stages by :func:`hf_pipeline_stage` (:mod:`.hf_stage`), an HF Mixtral on the package's MoE
(dispatch, expert parallelism, HDP-correct balance loss) by :func:`hf_moe_model` (:mod:`.hf_moe`)."""
from .expert_parallel import expert_parallel
from .hf_moe import HFMoEStage, hf_moe_model
from .hf_stage import HFPipelineStage, hf_pipeline_stage
from .llama import Llama, LlamaConfig
from .moe import MoE
from .presets import PRESETS, preset

__all__ = ["expert_parallel", "HFMoEStage", "hf_moe_model", "HFPipelineStage", "hf_pipeline_stage", "Llama", "LlamaConfig", "MoE", "PRESETS",
           "preset"]
