"""``python -m bytescale.train`` / ``torchrun --nproc_per_node N -m bytescale.train [options]``.

    torchrun --nproc_per_node 4 -m bytescale.train --data DIR --steps 100 --checkpoint-dir ckpt \\
        --save-every 20 [--resume] [--samples-log samples.jsonl] [--metrics metrics.jsonl] \\
        [--model tiny | --model path/to/config.json] [--config run.toml] [--section.key=value ...]

``--help`` lists every option (bytescale/train/config.py). Exit status 2 with one clear line for a
bad option, data, model or checkpoint.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .checkpoint import CheckpointError
    from .config import ConfigError, parse_args

    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"bytescale.train: error: {e}", file=sys.stderr)
        return 2
    from .trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except (ConfigError, CheckpointError) as e:
        import os

        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        if rank == 0:
            print(f"bytescale.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
    return 0


def run(argv: Optional[List[str]] = None) -> None:
    sys.exit(main(argv))


if __name__ == "__main__":
    run()
