"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that resume on another world size.

A checkpoint is a directory ``step-XXXXXXXX`` (the number of completed steps) holding DCP's files
and a manifest (``bytescale_checkpoint.json``: format, step, world size, model config, run
config). What it holds:

* ``app``: the model and the optimizer through ``torch.distributed.checkpoint.state_dict``
  (``get_state_dict`` / ``set_state_dict``, the optimizer state flattened per parameter), so
  replicated parameters, FSDP2-sharded ones and expert-parallel experts (named by their global
  index) are written in one layout and re-sharded on load to any world size and EP degree;
* ``trainer``: one JSON string: step, LR schedule, the loader's position (world-size
  independent: sampler epoch and offset) and every rank's RNG states.

Writes go to ``step-XXXXXXXX.tmp-<run id>`` and rank 0 renames the directory once DCP has
finished (its metadata written after every rank's data): a crash never leaves a half checkpoint
under a final name, and ``--resume`` takes the newest complete one. Saving is asynchronous by
default (``dcp.async_save`` on a Gloo group of its own, so the background writer never shares a
communicator with training); a new save first waits for the previous one.

Before loading, :func:`validate` checks the manifest, DCP's metadata, that every data file is
present and long enough, and that the model config and every tensor shape match the model being
trained; any problem is a :class:`CheckpointError` naming the checkpoint and what is wrong, and
nothing is written.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["CheckpointError", "AppState", "Checkpointer", "list_checkpoints", "validate", "MANIFEST"]

FORMAT = "bytescale.train.checkpoint/1"
MANIFEST = "bytescale_checkpoint.json"
_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (the message names it and the problem)."""


class AppState(Stateful):
    """The model and optimizer as DCP sees them (FQN-keyed, DTensor shards under FSDP2)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> Dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._options())
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self._options())

    @staticmethod
    def _options() -> StateDictOptions:
        # the optimizer state flattened to one key per parameter and field (state.FQN.exp_avg,
        # param_groups.FQN.lr): under expert parallelism each rank holds other experts, and a
        # per-FQN layout lets any EP degree read its own experts' state by name
        return StateDictOptions(strict=True, flatten_optimizer_state_dict=True)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(directory: str) -> List[Tuple[int, Path]]:
    """Complete checkpoints in ``directory`` (final name, manifest and DCP metadata), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file() and (p / ".metadata").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_manifest(path: Path) -> Dict[str, Any]:
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} (not a bytescale.train checkpoint, or incomplete)")
    try:
        man = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not format {FORMAT!r}")
    return man


def validate(path: Path, model_config: Dict[str, Any], shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, Any]:
    """Check a checkpoint against the model being trained (see module docstring); its manifest.

    ``shapes``: parameter FQN -> full (unsharded) shape of the current model.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    man = read_manifest(path)
    saved = man.get("model_config", {})
    diff = [k for k in sorted(set(saved) | set(model_config)) if saved.get(k) != model_config.get(k)]
    if diff:
        pairs = ", ".join(f"{k}: {saved.get(k)!r} there, {model_config.get(k)!r} here" for k in diff[:6])
        raise CheckpointError(f"checkpoint {path} was saved from another model ({pairs})")
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: unreadable DCP metadata (.metadata): {e}") from None
    need: Dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: data file {rel} is missing")
        if f.stat().st_size < size:
            raise CheckpointError(f"checkpoint {path} is corrupt: data file {rel} has {f.stat().st_size} "
                                  f"bytes, its index needs {size}")
    saved_shapes = {k[len("app.model."):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
                    if k.startswith("app.model.") and hasattr(v, "size")}
    missing = sorted(set(shapes) - set(saved_shapes))
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks parameters of this model: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(saved_shapes) - set(shapes))
    if extra:
        raise CheckpointError(f"checkpoint {path} holds parameters this model does not have: {extra[:5]}")
    for k, shp in shapes.items():
        if tuple(saved_shapes[k]) != tuple(shp):
            raise CheckpointError(f"checkpoint {path}: parameter {k} has shape {list(saved_shapes[k])} "
                                  f"there, {list(shp)} in this model")
    return man


class Checkpointer:
    """Save and find checkpoints of one run in ``directory`` (see module docstring).

    Collective: construct, :meth:`save`, :meth:`load` and :meth:`wait` on every rank.
    ``timeout``: of the background writer's Gloo group (None: torch's default for Gloo, 30 min);
    the trainer passes the run's process-group timeout.
    """

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
                 timeout: Optional[datetime.timedelta] = None) -> None:
        self.dir = Path(directory)
        self.keep = int(keep)
        self.async_save = bool(async_save)
        self.rank = dist.get_rank()
        run = [f"{int(time.time() * 1e3):x}-{os.getpid()}"]
        dist.broadcast_object_list(run, src=0)
        self.run_id = run[0]
        # the background writer gets a communicator of its own (a Gloo group beside the world),
        # with the run's timeout: a dead peer fails a save in time instead of after Gloo's 30 min
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.async_save else None
        self._pending: Optional[Tuple[Any, Path, Path]] = None
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    # -- finding -------------------------------------------------------------------------------
    def newest(self) -> Optional[Path]:
        found = list_checkpoints(str(self.dir))
        return found[-1][1] if found else None

    def clean_partial(self) -> None:
        """Remove directories of interrupted saves (rank 0; call before this run's first save)."""
        if self.rank == 0 and self.dir.is_dir():
            for p in self.dir.iterdir():
                if ".tmp-" in p.name and _NAME.match(p.name.split(".tmp-")[0]):
                    shutil.rmtree(p, ignore_errors=True)

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: Dict[str, Any], manifest: Dict[str, Any], block: bool = False) -> None:
        """Write checkpoint ``step`` (completed steps) of ``state`` ({"app": AppState, "trainer": str})."""
        self.wait()
        final = self.dir / step_name(step)
        tmp = self.dir / f"{step_name(step)}.tmp-{self.run_id}"
        if final.exists():
            raise CheckpointError(f"checkpoint {final} already exists; not overwriting it")
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)  # unique per run (run id); other ranks may create it too
            man = dict(manifest, format=FORMAT, step=step, world_size=dist.get_world_size(), time=time.time())
            (tmp / MANIFEST).write_text(json.dumps(man, indent=1, sort_keys=True))
        if self.async_save and not block:
            fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
            self._pending = (fut, tmp, final)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._finish(tmp, final)

    def poll(self) -> None:
        """Finish a background save that has completed (rename, prune); never blocks."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written and renamed."""
        if self._pending is None:
            return
        fut, tmp, final = self._pending
        self._pending = None
        try:
            fut.result()
        except Exception as e:  # e.g. a peer died or hung: Gloo's error alone names no checkpoint
            raise RuntimeError(f"checkpoint {final.name}: the background save into {tmp} failed (it stays "
                               f"incomplete; --resume ignores it): {type(e).__name__}: {e}") from e
        self._finish(tmp, final)

    def _finish(self, tmp: Path, final: Path) -> None:
        # rank 0's DCP call returns after the coordinator wrote .metadata, i.e. after every rank's
        # data: the checkpoint is complete, make it visible under its final name
        if self.rank != 0:
            return
        if not (tmp / ".metadata").is_file():
            raise CheckpointError(f"checkpoint save into {tmp} finished without DCP metadata")
        if final.exists():
            raise CheckpointError(f"checkpoint {final} appeared while saving; not overwriting it")
        os.replace(tmp, final)
        if self.keep:
            for _, old in list_checkpoints(str(self.dir))[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    # -- loading -------------------------------------------------------------------------------
    def load(self, path: Path, state: Dict[str, Any]) -> None:
        """Load ``state`` in place from ``path`` (validate it first)."""
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: loading failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
