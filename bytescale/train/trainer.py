"""The training loop of ``python -m bytescale.train`` (in the manner of TorchTitan's trainer).

One :class:`Trainer` owns a run: the process group (unless one exists), the dataset and HDP
loader, the model (bytescale's Llama or an HF model) and its parallelisation, AdamW with warm-up
and cosine decay, checkpoints and metrics. Each step: wait for this rank's micro-batches (the
loader plans the global batch over HDP units and prefetches the next one), the step executor
(:class:`bytescale.runtime.StepExecutor`: the rank's schedule of the plan, flat, lockstep under
FSDP2 or EP, 1F1B with ``--pp``; each micro-batch with its layout and offload ratio, the
token-level loss plus the MoE balance loss, gradient sync over the HDP dimension), clipping on the
summed gradient, the optimizer and LR steps, metrics, and a checkpoint when due. The job's mesh is
``pp x hdp x tp`` (``--pp``, ``--tp``, :func:`bytescale.init_mesh`); with ``--pp`` each rank
trains its pipeline stage.
"""
from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .build import LengthRecorder, build_dataset, build_model, build_optimizer, open_service, parallelize
from .checkpoint import AppState, Checkpointer, CheckpointError, list_checkpoints, read_manifest, validate
from .config import ConfigError, TrainConfig
from ..comm.traffic import traffic
from .metrics import MetricsLogger, peak_flops, plot_runs, traffic_fields, traffic_row

__all__ = ["Trainer", "init_distributed", "train_timeout"]


def train_timeout() -> datetime.timedelta:
    """The process groups' timeout: ``BYTESCALE_TRAIN_TIMEOUT_S`` seconds (default 600).

    Every collective and ring exchange of a run that waits longer than this for a peer raises
    (naming the op and the peer); so does the background checkpoint writer's group.
    """
    raw = os.environ.get("BYTESCALE_TRAIN_TIMEOUT_S", "600")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"BYTESCALE_TRAIN_TIMEOUT_S must be a positive number of seconds, got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def cuda_device_index(local_rank: int, device_count: int, transport: str) -> int:
    """The GPU of a training process: ``LOCAL_RANK`` on NCCL (one process per GPU); on the staged
    transport (``BYTESCALE_CUDA_TRANSPORT=staged``: several processes share the GPUs) ``LOCAL_RANK``
    modulo the number of GPUs, so two processes on a one-GPU machine both use ``cuda:0``."""
    if device_count < 1:
        raise ConfigError("train.device=cuda but no CUDA device is visible")
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    if transport == "staged":
        return local_rank % device_count
    if local_rank >= device_count:
        raise ConfigError(
            f"LOCAL_RANK {local_rank} but only {device_count} CUDA device(s) are visible: NCCL needs one "
            f"GPU per process (BYTESCALE_CUDA_TRANSPORT=staged lets processes share a GPU)")
    return local_rank


def _nccl_order() -> bool:
    from ..testing import nccl_order

    return nccl_order()


def init_distributed(device: str) -> bool:
    """Join (or, without torchrun, create a one-process) ``bytescale`` process group; True if created."""
    import bytescale  # noqa: F401  (registers the backend)

    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or os.environ.get("BYTESCALE_TRAIN_SOLO") == "1":
        # plain `python -m bytescale.train`: a world of one (a fresh port for every run)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), BYTESCALE_TRAIN_SOLO="1")
    timeout = train_timeout()
    if device == "cuda":
        from .. import _C

        local = cuda_device_index(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count(),
                                  _C.comm.cuda_transport())
        torch.cuda.set_device(local)
        dist.init_process_group("bytescale", device_id=torch.device("cuda", local), timeout=timeout)
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        dist.init_process_group("bytescale", timeout=timeout)
    return True


def _agree(msg: Optional[str]) -> Optional[str]:
    """Rank 0's verdict (an error message or None) on every rank."""
    box = [msg]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Trainer:
    """A training run (see module docstring). ``Trainer(cfg).train()`` returns rank 0's records."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        dev = cfg.train.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        if dev == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is available")
        self.owns_pg = init_distributed(dev)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
        self.name = cfg.train.name or ("HDP" if cfg.hdp.strategy != "static" else "static DPxCP")
        self.checkpointer: Optional[Checkpointer] = None
        self.logger: Optional[MetricsLogger] = None
        self.loader = None
        self.service = None
        self.source = None
        try:
            self._build()
        except BaseException:
            self.close(after_error=True)
            raise

    # -- construction ---------------------------------------------------------------------------
    def _build(self) -> None:
        from .. import init_mesh
        from .config import loader_config, planner_config
        from ..data import DatasetSource, HDPLoader
        from ..planner import static_cp_degree

        cfg = self.cfg
        try:
            self.mesh = init_mesh(tp=cfg.hdp.tp, pp=cfg.hdp.pp, ep=cfg.hdp.ep)
        except ValueError as e:
            raise ConfigError(f"hdp.tp={cfg.hdp.tp}, hdp.pp={cfg.hdp.pp}, hdp.ep={cfg.hdp.ep}: {e}") from None
        self.units = self.mesh.units
        self.hdp = self.units.num_units
        self.resume_path, self.max_length = self._find_resume_point()
        if cfg.data.spec:
            self.service, self.source, longest = open_service(cfg, self.rank)
            self.dataset, vocab = None, 0
            self.data_desc = f"data service, mixing spec {cfg.data.spec}"
        else:
            self.dataset, vocab, self.data_desc = build_dataset(cfg, self.max_length)
            lengths = self.dataset.lengths if hasattr(self.dataset, "lengths") else \
                [self.dataset.length(i) for i in range(len(self.dataset))]
            longest = int(max(lengths))
            self.source = LengthRecorder(DatasetSource(self.dataset, cfg.data.tokens_per_batch, cfg.data.seed))
        self.model_module, self.info = build_model(cfg, vocab, self.device)
        self.model, self.runtime = parallelize(self.model_module, self.info, cfg, self.device, self.mesh)
        self.model_module = self.model.module  # an HF model's pipeline stage is a new module
        from ..models.expert_parallel import expert_norm_groups

        self.expert_norm_groups = expert_norm_groups(self.model_module)
        if self.mesh.pp > 1:  # each stage holds its own parameters: their norms add up over the pipeline
            pp_group = self.mesh.group("pp")
            self.expert_norm_groups = {p: (self.expert_norm_groups[p], pp_group) if p in self.expert_norm_groups
                                       else pp_group for p in self.model_module.parameters()}
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg)
        self.capacity = cfg.hdp.capacity
        units = self.hdp
        what = "ranks" if self.mesh.tp == 1 else f"HDP units (of tp={self.mesh.tp} ranks)"
        if longest > self.capacity * units and not cfg.hdp.offload:
            if self.resume_path is None:
                raise ConfigError(f"the longest document ({longest} tokens) does not fit {units} {what} x "
                                  f"hdp.capacity {cfg.hdp.capacity}; raise --capacity, run on more ranks, or "
                                  "lower data.max_length (a mixing spec: the sources' max_length)")
            # a run resumed on fewer units keeps its documents: each unit holds more of them
            self.capacity = -(-longest // units)
            self._log0(f"[{self.name}] hdp.capacity raised from {cfg.hdp.capacity} to {self.capacity} tokens/unit: "
                       f"the run's longest document ({longest} tokens) must fit {units} {what}")
        static_cp = None
        if cfg.hdp.strategy == "static":
            if not (cfg.hdp.static_cp or longest):
                raise ConfigError("hdp.strategy=static with a mixing spec whose sources have no max_length: "
                                  "give hdp.static_cp (--static-cp)")
            try:
                static_cp = cfg.hdp.static_cp or static_cp_degree(longest, self.capacity, units)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.static_cp = static_cp
        self.planner = planner_config(cfg, self.capacity, static_cp)
        self.loader = HDPLoader(self.source, self.planner, loader_config(cfg), runtime=self.runtime,
                                units=self.units)
        self.step = 0
        self.peak = peak_flops(self.device, cfg.train.peak_tflops)
        from ..runtime import StepExecutor

        dev_type = self.device.type
        autocast = (lambda: torch.autocast(dev_type, dtype=torch.bfloat16)) if cfg.train.bf16 else None
        self.executor = StepExecutor(self.model, mesh=self.mesh, autocast=autocast)
        if cfg.checkpoint.dir:
            self.checkpointer = Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                             async_save=cfg.checkpoint.async_save, timeout=train_timeout())
            self._resume()
            self.checkpointer.clean_partial()
        mt = cfg.metrics
        tb = mt.tensorboard
        if tb is None and mt.path:
            try:
                import tensorboard  # noqa: F401

                tb = str(Path(mt.path).with_suffix("")) + "_tb"
            except ImportError:
                tb = None
        self.logger = MetricsLogger(rank=self.rank, total_steps=cfg.train.stop_after or cfg.train.steps,
                                    start_step=self.step,
                                    name=self.name, metrics_path=mt.path, samples_path=mt.samples_log,
                                    tensorboard_dir=tb, progress=cfg.train.progress, log_every=cfg.train.log_every)
        self.logger.print(
            f"[{self.name}] {self.world} ranks on {self.device.type}"
            f"{f' (hdp {self.hdp} x tp {self.mesh.tp})' if self.mesh.tp > 1 and self.mesh.pp == 1 else ''}"
            f"{f' (pp {self.mesh.pp} x hdp {self.hdp} x tp {self.mesh.tp})' if self.mesh.pp > 1 else ''}"
            f"{f' | EP {self.mesh.ep}' if self.mesh.ep > 1 else ''} | model {cfg.model.name} "
            f"({self.info.params / 1e6:.2f}M parameters{', MoE' if self.info.moe else ''}) | {self.data_desc} | "
            f"capacity {self.capacity} tokens/rank, global batch <= {cfg.data.tokens_per_batch} tokens | "
            f"planner {cfg.hdp.strategy}{f' cp={static_cp}' if static_cp else ''}"
            f"{' +offload' if cfg.hdp.offload else ''}{' | FSDP2' if cfg.hdp.fsdp else ''}"
            f"{' | bf16' if cfg.train.bf16 else ''}{' | act-ckpt' if cfg.train.activation_checkpointing else ''}"
            f"{' | compiled' if cfg.train.compile else ''}"
            f"{' | NCCL order on CPU' if self.device.type == 'cpu' and _nccl_order() else ''}"
            f" | steps {self.step}->{cfg.train.steps}")

    # -- checkpoints ----------------------------------------------------------------------------
    def _shapes(self) -> Dict[str, tuple]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        out = {}
        for k, v in get_model_state_dict(self.model_module).items():
            out[k] = tuple(v.shape)  # DTensor.shape is the full shape
        if self.mesh is not None and (self.mesh.ep > 1 or self.mesh.pp > 1):  # its experts / stage: the union
            parts: List[Any] = [None] * self.world
            dist.all_gather_object(parts, out)
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def _data_key(self) -> Dict[str, Any]:
        d = self.cfg.data
        key = {"data": d.path, "spec": d.spec, "tokens_per_batch": d.tokens_per_batch, "seed": d.seed}
        if self.dataset is not None:  # the data service checks its own fingerprint on resume
            key.update(max_length=self.max_length, length_scale=d.length_scale, documents=len(self.dataset))
            if (d.path or "").startswith("synthetic:"):
                key["synthetic"] = [d.synthetic_docs, d.synthetic_scale]
        return key

    def _find_resume_point(self):
        """(checkpoint to resume from or None, the run's max document length), agreed by all ranks.

        The longest document (``data.max_length``, default capacity x world size at the run's
        start) is part of the data: a resumed run takes it from the checkpoint, so it sees the
        same documents at any world size.
        """
        cc = self.cfg.checkpoint
        if cc.resume_from and not cc.dir:
            raise ConfigError("checkpoint.resume_from needs checkpoint.dir (where this run saves)")
        msg, path, max_len = None, None, self.cfg.data.max_length or self.cfg.hdp.capacity * self.hdp
        if self.rank == 0:
            try:
                found = list_checkpoints(cc.dir) if cc.dir else []
                if cc.resume_from:
                    path = Path(cc.resume_from)
                elif cc.resume:
                    path = found[-1][1] if found else None
                if path is None and found:
                    raise CheckpointError(
                        f"checkpoint directory {cc.dir} already holds checkpoints (newest {found[-1][1].name}); "
                        "pass --resume to continue that run, or use another directory")
                if path is not None:
                    man = read_manifest(path) if path.is_dir() else None
                    if man is None:
                        raise CheckpointError(f"checkpoint {path} does not exist")
                    max_len = int(man.get("data_key", {}).get("max_length") or max_len)
                    later = [p.name for s, p in found if s > int(man["step"])]
                    if later:
                        raise CheckpointError(f"checkpoint directory {cc.dir} holds checkpoints beyond the "
                                              f"resume point {path.name}: {later}; saving would overwrite them")
            except CheckpointError as e:
                msg = str(e)
        box = [msg, str(path) if path is not None else None, max_len]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise CheckpointError(box[0])
        if box[1] is None and cc.resume:
            self._log0(f"[{self.name}] --resume: no checkpoint in {cc.dir}; starting from step 0")
        return (Path(box[1]) if box[1] else None), int(box[2])

    def _resume(self) -> None:
        path = self.resume_path
        if path is None:
            return
        msg = None
        shapes = self._shapes()
        if self.rank == 0:
            try:
                man = validate(path, self.info.arch, shapes)
                if man.get("data_key") != self._data_key():
                    raise CheckpointError(f"checkpoint {path} was trained on other data settings: "
                                          f"{man.get('data_key')} there, {self._data_key()} here")
            except CheckpointError as e:
                msg = str(e)
        msg = _agree(msg)
        if msg:
            raise CheckpointError(msg)
        state = {"app": AppState(self.model_module, self.optimizer), "trainer": ""}
        self.checkpointer.load(path, state)
        tr = json.loads(state["trainer"])
        self.step = int(tr["step"])
        self.scheduler.load_state_dict(tr["scheduler"])
        self.loader.load_state_dict(tr["loader"])
        rng = pickle.loads(base64.b64decode(tr["rng"]))
        if self.rank < len(rng):
            torch.set_rng_state(rng[self.rank]["cpu"])
            if self.device.type == "cuda" and rng[self.rank].get("cuda") is not None:
                torch.cuda.set_rng_state(rng[self.rank]["cuda"])
        saved = tr.get("mesh") or {"hdp": tr["world_size"], "tp": 1}
        if int(saved.get("pp", 1)) != self.mesh.pp:
            raise CheckpointError(f"{path}: saved with {saved.get('pp', 1)} pipeline stages, resumed with "
                                  f"hdp.pp={self.mesh.pp}; a pipeline depth change is not supported (resume at "
                                  "the same --pp; the HDP degree may change)")
        ep_then, ep_now = int(saved.get("ep", 1)), self.mesh.ep
        eps = (f", ep {ep_then}", f", ep {ep_now}") if max(ep_then, ep_now) > 1 else ("", "")
        self._log0(f"[{self.name}] resumed from {path} (saved at {tr['world_size']} ranks, hdp {saved['hdp']} x "
                   f"tp {saved['tp']}{eps[0]}; now {self.world}, hdp {self.hdp} x tp {self.mesh.tp}{eps[1]}) "
                   f"at step {self.step}")

    def _log0(self, msg: str) -> None:
        if self.logger is not None:
            self.logger.print(msg)
        elif self.rank == 0:
            print(msg, flush=True)

    def save(self, block: bool = False) -> None:
        mine = {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}
        rngs: List[Any] = [None] * self.world
        dist.all_gather_object(rngs, mine)
        trainer = {"step": self.step, "world_size": self.world, "mesh": self.mesh.to_dict(),
                   "scheduler": self.scheduler.state_dict(),
                   "loader": self.loader.state_dict(),
                   "rng": base64.b64encode(pickle.dumps(rngs)).decode()}
        state = {"app": AppState(self.model_module, self.optimizer), "trainer": json.dumps(trainer)}
        manifest = {"model_config": self.info.arch, "data_key": self._data_key(), "config": self.cfg.to_dict()}
        self.checkpointer.save(self.step, state, manifest, block=block)

    # -- the loop -------------------------------------------------------------------------------
    def train_step(self, step) -> Dict[str, float]:
        """One step through the step executor (forward and backward of every micro-batch in the
        plan's order, gradient sync), then clipping, the optimizer and the LR schedule."""
        from ..runtime.grad import clip_grad_norm_

        out = self.executor.run(step)
        norm = clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip or float("inf"),
                               sum_over=self.expert_norm_groups)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": out.loss, "aux": out.aux, "compute": out.compute_s, "grad_norm": float(norm),
                "lr": float(lr), "mbs": float(out.micro_batches)}

    def train(self) -> List[Dict[str, Any]]:
        cfg = self.cfg
        last = cfg.train.stop_after or cfg.train.steps
        it = iter(self.loader)
        traffic(reset=True)  # the first step's counts start here
        while self.step < last:
            t0 = time.perf_counter()
            step = next(it)
            wait = time.perf_counter() - t0
            if step.index != self.step:
                raise RuntimeError(f"loader at step {step.index}, trainer at {self.step}")
            self.logger.samples(step.index, step.sample_ids)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            out = self.train_step(step)
            elapsed = time.perf_counter() - t0
            # every TP rank of a unit computes the unit's loss: count it once (TP index 0); with
            # pipelines only the last stage has a loss (the others report 0)
            first = float(self.mesh.coords()["tp"] == 0)
            moved = traffic(reset=True)  # this step's, counted by the transport (before the all-gather)
            mine = torch.tensor([out["loss"] * first, out["aux"] * first, out["compute"], wait, elapsed,
                                 out["mbs"], *traffic_row(moved)], dtype=torch.float64)
            table = [torch.zeros_like(mine) for _ in range(self.world)]
            dist.all_gather(table, mine)
            t = torch.stack(table)
            step_time = float(t[:, 4].max())
            lengths = self.source.lengths.get(step.index, ())
            flops = self.info.flops.step_flops(lengths)
            rings = step.plan.ring_sizes()  # batch position -> ranks, sharded sequences only
            rec = {"step": step.index, "loss": float(t[:, 0].sum()), "aux_loss": float(t[:, 1].sum()),
                   "lr": out["lr"], "grad_norm": out["grad_norm"], "tokens": step.global_tokens,
                   "documents": len(step.sample_ids), "step_time_s": step_time,
                   "tokens_per_s": step.global_tokens / step_time,
                   "mfu": flops / (step_time * self.world * self.peak),
                   "data_wait_s": float(t[:, 3].max()),
                   "compute_s": float(t[:, 2].max()),  # the micro-batch loop (fwd+bwd+grad sync) of the slowest rank
                   "imbalance": float(t[:, 2].max() / max(float(t[:, 2].mean()), 1e-12)),
                   "micro_batches": [int(x) for x in t[:, 5].tolist()],
                   "ring_sizes": sorted(rings.values(), reverse=True)[:8],
                   "sequences": len(lengths), "sharded_sequences": len(rings),
                   "sharded_tokens": int(sum(lengths[i] for i in rings if i < len(lengths)))}
            rec.update(traffic_fields(t[:, 6:]),
                       local_token_share=1 - rec["sharded_tokens"] / max(step.global_tokens, 1))
            if self.device.type == "cuda":  # this rank's peak device memory in the step
                rec["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                rec["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            self.logger.log(rec, step.plan.summary())
            self.step += 1
            if self.checkpointer is not None:
                self.checkpointer.poll()
                k = cfg.checkpoint.save_every
                if (k and self.step % k == 0) or self.step == last:
                    self.save(block=self.step == last)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if self.service is not None or self.cfg.data.spec:
            self.source.close()
            dist.barrier()  # every rank's client is done before rank 0 stops the service (close())
        records = self.logger.records if self.logger is not None else []
        self._finish_plot(records)
        return records

    def _finish_plot(self, records: List[Dict[str, Any]]) -> None:
        if self.rank != 0 or not records:
            return
        out = self.cfg.metrics.plot or (str(Path(self.cfg.metrics.path).with_suffix(".png"))
                                        if self.cfg.metrics.path else None)
        if out and plot_runs({self.name: records}, out):
            self._log0(f"[{self.name}] loss and throughput plot: {out}")

    def close(self, after_error: bool = False) -> None:
        """Release the background writer, the loader, the logs and (if created here) the process group.

        ``after_error``: the run is ending with an exception (often a dead peer, which also fails a
        pending background save): every release is still attempted, and one that fails is reported
        on stderr instead of raised, so the error that ended the run is the one that propagates.
        """
        def release(what: str, fn) -> None:
            try:
                fn()
            except Exception as e:
                if not after_error:
                    raise
                print(f"bytescale.train: rank {self.rank}: {what} failed while closing after the error: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

        if self.checkpointer is not None:
            ck, self.checkpointer = self.checkpointer, None
            release("the checkpoint writer", ck.close)
        if self.loader is not None:
            loader, self.loader = self.loader, None
            release("the loader", loader.close)
        if getattr(self, "source", None) is not None:
            source, self.source = self.source, None
            release("the batch source", source.close)
        if self.service is not None:
            service, self.service = self.service, None
            release("the data service", service.close)
        if self.logger is not None:
            logger, self.logger = self.logger, None
            release("the metrics logger", logger.close)
        if self.owns_pg and dist.is_initialized():
            self.owns_pg = False
            release("destroying the process group", dist.destroy_process_group)
