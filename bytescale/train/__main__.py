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
    failed = True
    try:
        trainer = Trainer(cfg)
        trainer.train()
        failed = False
    except (ConfigError, CheckpointError) as e:
        if _rank() == 0:
            print(f"bytescale.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        _explain_failure(cfg, trainer, e)
        raise
    finally:
        if trainer is not None:
            trainer.close(after_error=failed)
    return 0


def _rank() -> int:
    import os

    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _explain_failure(cfg, trainer, e: BaseException) -> None:
    """One line on stderr (every rank): where the run failed and how to continue it.

    When a rank dies (a crash, an OOM kill, a lost node) the others fail in the collective or ring
    exchange they were in: at once when the transport sees the closed connection, at the latest
    after the process-group timeout (``BYTESCALE_TRAIN_TIMEOUT_S``).
    """
    step = getattr(trainer, "step", None)
    where = f" at step {step}" if step is not None else ""
    hint = (f"; if a peer rank died, restart the job with --resume to continue from the newest complete "
            f"checkpoint in {cfg.checkpoint.dir}" if cfg.checkpoint.dir else
            "; if a peer rank died, restart the job (no --checkpoint-dir: from step 0)")
    msg = str(e).splitlines()[0] if str(e) else ""
    print(f"bytescale.train: rank {_rank()} failed{where}: {type(e).__name__}: {msg}{hint}", file=sys.stderr,
          flush=True)


def run(argv: Optional[List[str]] = None) -> None:
    sys.exit(main(argv))


if __name__ == "__main__":
    run()
