"""Runtime: the HDP model wrapper, the token-level loss and selective activation offloading."""
from .loss import IGNORE_INDEX, count_loss_tokens, token_level_loss
from .offload import offload
from .parallel import HybridDataParallel

__all__ = ["HybridDataParallel", "token_level_loss", "count_loss_tokens", "IGNORE_INDEX", "offload"]
