"""``python -m bytescale.train``: a training entry point over bytescale (HDP, the data service,
bf16, FSDP2, checkpoints that resume on another world size, metrics).

Pieces: :mod:`.config` (TrainConfig), :mod:`.build` (data, model, parallelisation),
:mod:`.trainer` (the loop), :mod:`.checkpoint` (DCP), :mod:`.metrics` (what a person watches).
"""
from .config import ConfigError, TrainConfig, parse_args

__all__ = ["ConfigError", "TrainConfig", "parse_args", "Trainer", "main"]


def __getattr__(name):  # the trainer imports torch.distributed pieces: load on use
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    if name == "main":
        from .__main__ import main

        return main
    raise AttributeError(name)
