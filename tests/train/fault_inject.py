"""One rank of a fault-injection run (tests/train/test_faults.py): ``python fault_inject.py SPEC ARGS...``
(or :func:`forked`, the same in a process forked from the test harness' forkserver).

SPEC is JSON: ``{"point": P, "rank": R, "step": K, "signal": S, "report": FILE}``. The process runs
the real training entry point (``bytescale.train.__main__.main(ARGS)``) unchanged. If this is rank
R, a test-only hook wraps the Python function at point P and sends this process signal S the first
time that function is entered at training step >= K: SIGKILL (the process dies there: no cleanup,
no exception, sockets closed by the kernel, like a crashed or OOM-killed rank) or SIGSTOP (it
freezes with its connections open, like a hung rank: the others can only time out):

* ``ring``: ``bytescale.attention.layout.ring_attention``, a sharded micro-batch's ring attention
  (the other ring members are then inside the K/V exchange);
* ``ring_bwd``: ``torch.ops.bytescale.ring_attn_bwd``, the ring's backward (dK/dV exchange);
* ``checkpoint``: ``Checkpointer.save``, the start of a checkpoint save (the others' background
  writers are then in DCP's collectives);
* ``grad_sync``: ``HybridDataParallel._launch``, the start of a gradient bucket's all-reduce;
* ``fingerprint``: ``HDPLoader._verify``, the loader's per-step plan fingerprint all-reduce;
* ``dyn_group``: ``torch.distributed.all_reduce`` on a :class:`bytescale.comm.DynamicGroup` (the
  MoE balance loss' per-document expert counts over a ring);
* ``none``: no hook (the parent may SIGKILL a rank at a wall-clock time).

Every rank reports how ``main`` ended into ``FILE.<rank>`` (JSON: the time, the exception's type
and message), written before the exception propagates, so the parent can time and check the
error each survivor raised.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
import traceback


_SIGNAL = signal.SIGKILL


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), _SIGNAL)


def _install(point: str, at_step: int) -> None:
    from bytescale.train import trainer as trainer_mod

    state = {"step": -1}
    orig_step = trainer_mod.Trainer.train_step

    @functools.wraps(orig_step)
    def train_step(self, step):
        state["step"] = step.index
        return orig_step(self, step)

    trainer_mod.Trainer.train_step = train_step

    def due() -> bool:
        return state["step"] >= at_step

    def kill_on_entry(owner, name):
        orig = getattr(owner, name)

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if due():
                _die()
            return orig(*args, **kwargs)

        setattr(owner, name, wrapper)

    if point == "ring":
        from bytescale.attention import layout

        kill_on_entry(layout, "ring_attention")
    elif point == "ring_bwd":
        import torch

        from bytescale.attention import ops  # noqa: F401  (registers the ops and their autograd)

        kill_on_entry(torch.ops.bytescale, "ring_attn_bwd")
    elif point == "checkpoint":
        from bytescale.train.checkpoint import Checkpointer

        kill_on_entry(Checkpointer, "save")
    elif point == "grad_sync":
        from bytescale.runtime.parallel import HybridDataParallel

        kill_on_entry(HybridDataParallel, "_launch")
    elif point == "fingerprint":
        from bytescale.data.loader import HDPLoader

        orig_verify = HDPLoader._verify

        @functools.wraps(orig_verify)
        def verify(self, step):
            if step.index >= at_step:  # the loader verifies step k before the trainer runs it
                _die()
            return orig_verify(self, step)

        HDPLoader._verify = verify
    elif point == "dyn_group":
        import torch.distributed as dist

        from bytescale.comm import DynamicGroup

        orig_ar = dist.all_reduce

        @functools.wraps(orig_ar)
        def all_reduce(tensor, *args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if isinstance(group, DynamicGroup) and due():
                _die()
            return orig_ar(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
    elif point != "none":
        raise ValueError(f"fault_inject: unknown point {point!r}")


def forked(spec: str, argv: list, env: dict, log: str) -> None:
    """The same rank as ``python fault_inject.py SPEC ARGV...``, in a process forked from the test
    harness' forkserver (torch already imported): its own session, the given environment, stdout
    and stderr to ``log``; exits with ``main``'s status (an exception: its traceback, status 1)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [__file__, spec, *argv]
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    if rank == spec["rank"] and spec["point"] != "none":
        global _SIGNAL
        _SIGNAL = signal.Signals[spec.get("signal", "SIGKILL")]
        _install(spec["point"], int(spec["step"]))
    from bytescale.train.__main__ import main as train_main

    report = f"{spec['report']}.{rank}"
    try:
        code = train_main(sys.argv[2:])
    except BaseException as e:
        with open(report, "w") as f:
            json.dump({"time": time.time(), "type": type(e).__name__, "message": str(e),
                       "traceback": traceback.format_exc()}, f)
        raise
    with open(report, "w") as f:
        json.dump({"time": time.time(), "type": None, "message": None, "code": code}, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
