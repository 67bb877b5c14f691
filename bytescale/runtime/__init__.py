"""Runtime: the step executor (one class for every schedule), the schedule, the stage I/O, the HDP model
wrapper, the step's types, the token-level loss, gradient norms of any parameter layout and selective
activation offloading."""
from .executor import StepExecutor, StepOutput, default_forward
from .grad import clip_grad_norm_, grad_norm
from .loss import IGNORE_INDEX, count_loss_tokens, token_level_loss
from .offload import offload
from .parallel import HybridDataParallel
from .schedule import Schedule, ScheduleKind, build_schedule, pipeline_order, schedule_kind
from .types import MicroBatch, Step

__all__ = ["HybridDataParallel", "StepExecutor", "StepOutput", "default_forward", "Schedule", "ScheduleKind",
           "build_schedule", "schedule_kind", "pipeline_order", "MicroBatch", "Step",
           "token_level_loss", "count_loss_tokens", "IGNORE_INDEX", "offload", "clip_grad_norm_", "grad_norm"]
