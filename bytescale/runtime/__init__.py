"""Runtime: the step executor (and its pipeline-stage form), the HDP model wrapper, the step's types, the token-level loss,
gradient norms of any parameter layout and selective activation offloading."""
from .executor import StepExecutor, StepOutput, default_forward
from .grad import clip_grad_norm_, grad_norm
from .loss import IGNORE_INDEX, count_loss_tokens, token_level_loss
from .offload import offload
from .parallel import HybridDataParallel
from .pipeline import PipelineExecutor, pipeline_order
from .types import MicroBatch, Step

__all__ = ["HybridDataParallel", "StepExecutor", "PipelineExecutor", "pipeline_order", "StepOutput", "default_forward", "MicroBatch", "Step",
           "token_level_loss", "count_loss_tokens", "IGNORE_INDEX", "offload", "clip_grad_norm_", "grad_norm"]
