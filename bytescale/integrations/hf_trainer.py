"""HDP inside transformers' ``Trainer`` and the trainers built on it (TRL's ``SFTTrainer``).

``HDPTrainerMixin`` goes first in the bases of any ``Trainer`` subclass (``HDPTrainer`` is
``Trainer`` with it; :func:`hdp_trainer` makes the class for you)::

    dist.init_process_group("bytescale")            # before the TrainingArguments (torchrun)
    trainer = hdp_trainer(SFTTrainer)(model=model, args=SFTConfig(...), train_dataset=ds,
                                      planner=PlannerConfig(capacity=16384),
                                      loader=LoaderConfig(tokens_per_batch=1 << 20))
    trainer.train()                                 # or train(resume_from_checkpoint=True)

What changes inside the trainer, and nothing else:

* the train data loader is an :class:`~bytescale.integrations.hf_data.HDPTrainLoader` over the
  trainer's own (tokenized) dataset: one item per optimizer step, this rank's share of one global
  batch of ``tokens_per_batch`` tokens planned across all ranks (documents never padded; TRL's
  packed rows are split back into their documents; ``labels`` masks are kept);
* the model is wrapped in :class:`~bytescale.HybridDataParallel` (not DDP) with
  ``attn_implementation="bytescale"``, and :meth:`training_step` runs the plan's micro-batches, each
  under its layout, through :class:`~bytescale.StepExecutor`: the token-level loss over the global
  batch (what ``num_items_in_batch`` normalises to in HF, exactly), one gradient sum per step;
* checkpoints carry the loader's position (``bytescale_loader.json``), which a resumed run restores
  on any number of ranks, so it sees the uninterrupted run's batches; evaluation runs the trainer's
  usual (padded) eval loop under the model's original attention implementation.

Options that cannot apply are refused when the trainer is built (gradient accumulation: the plan
already runs as many micro-batches per rank as the step needs; ``group_by_length`` / another
``train_sampling_strategy``, a sampler or train loader of one's own; ``fp16``; a loss of one's own;
DeepSpeed / FSDP / TP configs).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import LoaderConfig, PlannerConfig, RuntimeConfig
from ..runtime import HybridDataParallel, StepExecutor
from ..runtime.types import Step
from .hf_data import HDPTrainLoader, HFDocuments

__all__ = ["HDPTrainerMixin", "HDPTrainer", "hdp_trainer", "LOADER_STATE"]

LOADER_STATE = "bytescale_loader.json"
"""The file in a checkpoint folder that holds the HDP loader's position."""

_ATTN = "bytescale"


def _is_sft(cls: type) -> bool:
    """TRL's SFTTrainer, whose own loss (loss_type "nll") is the token-level loss HDP computes."""
    return cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl.")


@contextlib.contextmanager
def _kept_position(loader: HDPTrainLoader):
    """Inside Trainer's epoch loop, resuming skips the epoch's first batches by rebuilding the data
    loader; the HDP loader instead restored its exact position from the checkpoint, so it passes
    through unchanged (other loaders are skipped as before)."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.skip_first_batches

    def skip(dataloader: Any, num_batches: int = 0) -> Any:
        return dataloader if dataloader is loader else original(dataloader, num_batches)

    hf_trainer.skip_first_batches = skip
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original


class HDPTrainerMixin:
    """Hybrid data parallelism for a ``transformers.Trainer`` subclass (module docstring).

    Keyword args (besides the trainer's own):
        planner: how each global batch is planned (``capacity``: tokens per micro-batch per rank).
        loader: ``tokens_per_batch`` (the global batch of one optimizer step) and the sample
            order's ``seed``; its ``max_steps`` is ignored (the trainer's ``max_steps`` and epochs
            count).
        runtime: gradient buckets and the like (:class:`~bytescale.config.RuntimeConfig`).
    """

    def __init__(self, *args: Any, planner: PlannerConfig, loader: LoaderConfig,
                 runtime: Optional[RuntimeConfig] = None, **kwargs: Any) -> None:
        import bytescale.models.hf  # noqa: F401  (registers attn_implementation="bytescale")

        if not isinstance(planner, PlannerConfig):
            raise TypeError(f"HDP trainer: planner must be a bytescale.PlannerConfig, got {type(planner).__name__}")
        if not isinstance(loader, LoaderConfig):
            raise TypeError(f"HDP trainer: loader must be a bytescale.LoaderConfig, got {type(loader).__name__}")
        if planner.pp != 1:
            raise ValueError("HDP trainer: pipelines are not supported by the Trainer integration; use "
                             "python -m bytescale.train")
        self.hdp_planner = planner
        self.hdp_loader = loader
        self.hdp_runtime = runtime or RuntimeConfig()
        self._hdp_model: Optional[HybridDataParallel] = None
        self._hdp_executor: Optional[StepExecutor] = None
        self._hdp_train_loader: Optional[HDPTrainLoader] = None
        self._hdp_eval_attn = "sdpa"
        super().__init__(*args, **kwargs)
        self._hdp_check()
        if self.model is not None:
            self._hdp_attention(self.model)

    # -- what cannot apply -----------------------------------------------------------------------
    def _hdp_check(self) -> None:
        args = self.args
        problems = []
        if args.gradient_accumulation_steps != 1:
            problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps}: the plan already runs "
                            "as many micro-batches per rank as the step needs; set it to 1 and size the step with "
                            "LoaderConfig(tokens_per_batch=...)")
        strategy = getattr(args, "train_sampling_strategy", "random")
        if getattr(args, "group_by_length", False) or strategy != "random":
            what = "group_by_length=True" if getattr(args, "group_by_length", False) else \
                f"train_sampling_strategy={strategy!r}"
            problems.append(f"{what}: the HDP loader draws each global batch (shuffled with LoaderConfig.seed) and the "
                            "planner lays it out; use the default random sampling")
        if args.fp16:
            problems.append("fp16=True: no loss scaling under HDP; use bf16=True (autocast) or full precision")
        if args.auto_find_batch_size:
            problems.append("auto_find_batch_size=True: the step's size is LoaderConfig(tokens_per_batch=...)")
        if args.label_smoothing_factor:
            problems.append(f"label_smoothing_factor={args.label_smoothing_factor}: HDP trains the token-level "
                            "cross-entropy")
        if getattr(self, "compute_loss_func", None) is not None:
            problems.append("compute_loss_func: HDP computes the token-level loss over the global batch itself")
        if getattr(args, "loss_type", "nll") != "nll":
            problems.append(f"loss_type={args.loss_type!r}: HDP trains the token-level cross-entropy ('nll')")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or getattr(args, "parallelism_config", None) is not None:
            problems.append("DeepSpeed / FSDP / parallelism_config: HDP replaces data and context parallelism "
                            "(FSDP2, TP and PP: python -m bytescale.train)")
        if args.n_gpu > 1:
            problems.append(f"n_gpu={args.n_gpu} (nn.DataParallel): launch one process per device with torchrun")
        if self.train_dataset is not None:
            try:
                HFDocuments.check(self.train_dataset)
            except (TypeError, ValueError) as e:
                problems.append(str(e).removeprefix("HDP trainer: "))
        problems += self._hdp_overrides()
        if not dist.is_initialized():
            problems.append("torch.distributed is not initialized: call dist.init_process_group('bytescale') before "
                            "the TrainingArguments (under torchrun; a single process too)")
        else:
            from ..comm import BACKEND_NAME

            world = dist.get_world_size()
            if args.world_size != world:
                problems.append(f"the TrainingArguments see {args.world_size} process(es) but torch.distributed has "
                                f"{world}: launch with torchrun, and on CPU pass use_cpu=True")
            if world > 1 and dist.get_backend() != BACKEND_NAME:
                problems.append(f"the process group's backend is {dist.get_backend()!r}; HDP's rings need "
                                f"dist.init_process_group({BACKEND_NAME!r})")
            from ..comm.mesh import current_mesh

            mesh = current_mesh()
            if mesh is not None and not mesh.units.is_identity:
                problems.append(f"a mesh of {mesh.units.describe()}: the Trainer integration runs plain HDP (one "
                                "rank per unit); TP / PP / EP: python -m bytescale.train")
        if problems:
            raise ValueError(f"{type(self).__name__} (bytescale HDP) cannot apply these options:\n  - "
                             + "\n  - ".join(problems))
        if not args.average_tokens_across_devices:
            warnings.warn("average_tokens_across_devices=False: HDP always divides by the global batch's number of "
                          "loss tokens (the token-level loss), so every rank's tokens weigh the same", stacklevel=3)
        if getattr(self, "aux_loss_enabled", False):
            warnings.warn("the MoE router's auxiliary loss is not added under HDP (it is not normalised over the "
                          "global batch); routing trains without it", stacklevel=3)

    def _hdp_overrides(self) -> list:
        """Methods of other classes in the trainer's bases that HDP replaces and cannot honour."""
        out = []
        rules = {"get_train_dataloader": "a train data loader", "_get_train_sampler": "a train sampler",
                 "compute_loss": "a loss", "training_step": "a training step"}
        for cls in type(self).__mro__:
            if cls in (HDPTrainerMixin, Trainer) or not issubclass(cls, Trainer):
                continue
            for name, what in rules.items():
                allowed = _is_sft(cls) and name in ("compute_loss", "training_step")
                if name in vars(cls) and not allowed:
                    out.append(f"{cls.__name__}.{name} defines {what} of its own, which HDP replaces (the HDP loader "
                               "plans each step; the loss is the token-level loss over the global batch)")
        return out

    def _hdp_attention(self, model: nn.Module) -> None:
        """The model trains with attn_implementation="bytescale"; its own one serves evaluation."""
        config = getattr(model, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is None or not hasattr(model, "set_attn_implementation"):
            raise TypeError("HDP trainer: the model must be a transformers PreTrainedModel whose attention goes "
                            f"through the attention interface, got {type(model).__name__}")
        if impl != _ATTN:
            self._hdp_eval_attn = impl
            model.set_attn_implementation(_ATTN)

    # -- training ------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> HDPTrainLoader:
        """The HDP loader over the trainer's own dataset (one item per optimizer step)."""
        if self.train_dataset is None:
            raise ValueError("HDP trainer: training requires a train_dataset")
        if self._hdp_train_loader is not None:
            self._hdp_train_loader.close()
        docs = HFDocuments(self.train_dataset)
        planner, world = self.hdp_planner, dist.get_world_size()
        longest = int(docs.lengths.max())
        if planner.memory is None and not planner.offload and longest > planner.capacity * world:
            i = int(docs.lengths.argmax())
            raise ValueError(f"HDP trainer: document {i} of the train_dataset (row {int(docs.row[i])}) has {longest} "
                             f"tokens, more than capacity {planner.capacity} x {world} ranks hold; raise "
                             "PlannerConfig(capacity=...), use more ranks or truncate (SFTConfig(max_length=...))")
        self._hdp_train_loader = HDPTrainLoader(docs, planner, self.hdp_loader, self.hdp_runtime)
        return self._hdp_train_loader

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not training:
            return model.module if isinstance(model, HybridDataParallel) else model
        if isinstance(model, HybridDataParallel):
            return model
        self._hdp_attention(model)
        self._hdp_model = HybridDataParallel(model, config=self.hdp_runtime)
        autocast = None
        if self.args.bf16:
            device = self.args.device.type

            def autocast():
                return torch.autocast(device_type=device, dtype=torch.bfloat16)
        self._hdp_executor = StepExecutor(self._hdp_model, autocast=autocast)
        return self._hdp_model  # not self.model: the trainer then skips accelerate's DDP wrapping

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One optimizer step's forward and backward: the plan's micro-batches on this rank, the
        gradients summed over ranks. Returns the global batch's loss (the same on every rank)."""
        step = getattr(inputs, "step", None)
        if not isinstance(step, Step) or self._hdp_executor is None:
            raise TypeError("HDP trainer: training_step expects the HDP loader's batch (HDPBatch) and the "
                            f"HybridDataParallel model; got {type(inputs).__name__}")
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        with getattr(self, "maybe_activation_offload_context", contextlib.nullcontext()):  # TRL's option
            out = self._hdp_executor.run(step)
        loss = torch.tensor([out.loss], dtype=torch.float64, device=self.args.device)
        dist.all_reduce(loss, group=self._hdp_model.process_group)  # this rank's share -> the whole batch's
        return loss[0]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._hdp_train_loader is not None:  # stop the prefetch of a step that will not run
                self._hdp_train_loader.close()
                self._hdp_train_loader = None

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint is not None and not self.args.ignore_data_skip \
                and isinstance(train_dataloader, HDPTrainLoader):
            self._hdp_restore(train_dataloader, resume_from_checkpoint)
        return model, train_dataloader

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        loader = kwargs.get("train_dataloader")
        with _kept_position(loader) if isinstance(loader, HDPTrainLoader) else contextlib.nullcontext():
            return super()._run_epoch(*args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        loader = self._hdp_train_loader
        if loader is not None and self.args.should_save:  # the same state on every rank: one writer
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            state = {"loader": loader.state_dict(), "global_step": self.state.global_step,
                     "documents": len(loader.docs), "tokens": int(loader.docs.lengths.sum())}
            tmp = os.path.join(folder, LOADER_STATE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, os.path.join(folder, LOADER_STATE))  # written before the trainer's state
        super()._save_checkpoint(model, trial)

    def _hdp_restore(self, loader: HDPTrainLoader, checkpoint: str) -> None:
        path = os.path.join(checkpoint, LOADER_STATE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"HDP trainer: {path} is missing, so the data position of checkpoint {checkpoint} "
                                    "is unknown (not written by an HDP trainer?); pass ignore_data_skip=True to start "
                                    "the data from the beginning")
        try:
            with open(path) as f:
                state = json.load(f)
            saved = (int(state["documents"]), int(state["tokens"]), int(state["global_step"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"HDP trainer: cannot read {path}: {e}") from None
        have = (len(loader.docs), int(loader.docs.lengths.sum()), self.state.global_step)
        if saved != have:
            raise ValueError(f"HDP trainer: checkpoint {checkpoint} was saved at step {saved[2]} over {saved[0]} "
                             f"documents ({saved[1]} tokens); this run is at step {have[2]} over {have[0]} documents "
                             f"({have[1]} tokens): not the same training data")
        loader.load_state_dict(state["loader"])

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The trainer's own evaluation (padded batches) under the model's original attention."""
        model = self.model
        impl = model.config._attn_implementation
        if impl != _ATTN:
            return super().evaluation_loop(*args, **kwargs)
        model.set_attn_implementation(self._hdp_eval_attn)
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            model.set_attn_implementation(impl)


class HDPTrainer(HDPTrainerMixin, Trainer):
    """``transformers.Trainer`` with hybrid data parallelism (:class:`HDPTrainerMixin`)."""


_CLASSES: dict = {}


def hdp_trainer(trainer_cls: type) -> type:
    """The HDP version of a ``Trainer`` subclass: ``class HDP<Name>(HDPTrainerMixin, trainer_cls)``
    (made once per class)."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"hdp_trainer: expected a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, HDPTrainerMixin):
        return trainer_cls
    if trainer_cls not in _CLASSES:
        _CLASSES[trainer_cls] = type(f"HDP{trainer_cls.__name__}", (HDPTrainerMixin, trainer_cls),
                                     {"__module__": __name__, "__doc__": trainer_cls.__doc__})
    return _CLASSES[trainer_cls]
