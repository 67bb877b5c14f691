"""The plan-driven HDP loader.

Per step it (1) takes the next global batch's metadata (sample ids, lengths) from a
:class:`~bytescale.data.source.BatchSource` (a dataset's deterministic, resumable sampler, or a
data-service client), (2) plans it with the C++ planner (:class:`bytescale.config.PlannerConfig`), and (3) materialises
ONLY this rank's micro-batches, in the plan's execution order: input ids, labels, position ids,
the typed micro-batch plan and its attention layout (always attached).

Planning: every rank plans the same metadata deterministically (the planner is C++ and takes
milliseconds even for 16K ranks), which needs no broadcast and no central planner process; a
63-bit fingerprint of the plan is compared across ranks once per step so ranks with
mismatched configurations fail with a clear error instead of deadlocking in a ring. The check
is the agreement primitive (:func:`bytescale.comm.agree`: every rank sees every rank's
fingerprint; an all-reduce of MIN and MAX under another backend).

Token order inside a micro-batch (:meth:`MicroBatchPlan.token_ranges`): the local documents first
(whole), then each sharded document's two zig-zag chunks. Labels are the next token of the SAME
document: the label of a chunk's last token is the first token of the following chunk, read
directly from the dataset even when that chunk lives on another rank; the last token of a
document has no label. Position ids are positions inside the document (RoPE-correct for chunks).
Tokens come from the source's ``tokens(sample_id, start, end)``: a rank pulls only its own ranges.

The next step is prepared in a background thread while the current one trains. The loader's
state (the source's position and the step) is checkpointable and independent of the world size: a
run resumed on any number of ranks sees exactly the batches it would have seen.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import replace
import hashlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..config import LoaderConfig, PlannerConfig, RuntimeConfig
from ..planner.types import MicroBatchPlan
from ..planner.units import UnitMap
from ..planner.feasibility import longest_document
from .dataset import TokenDataset
from .oversize import StreamingOversize, open_stream
from .source import BatchSource, DatasetSource, GlobalBatch
from ..runtime.types import IGNORE_INDEX, MicroBatch, Step

__all__ = ["GlobalBatchSampler", "HDPLoader", "materialize"]


def materialize(dataset: Union[TokenDataset, BatchSource], plan: MicroBatchPlan,
                bf16_grad_comm: bool = False, offsets: Optional[Sequence[int]] = None) -> MicroBatch:
    """Read exactly this micro-batch's tokens (plus one label token per range) from the dataset
    or batch source (anything with ``tokens(sample_id, start, end)``).

    ``plan`` must be bound to dataset ids (:meth:`MicroBatchPlan.bind`). ``offsets``: per batch
    position, where the planned document starts in the drawn one (a piece of a split document;
    its last token has no label, as any document's).
    """
    ids, labels, pos = [], [], []
    for doc, a, b in plan.token_ranges():
        if b <= a:
            continue
        if doc.sample_id < 0:
            raise ValueError(f"materialize: document at batch position {doc.batch_pos} has no sample id; "
                             "bind the plan to the batch first (MicroBatchPlan.bind)")
        off = int(offsets[doc.batch_pos]) if offsets is not None else 0
        ids.append(dataset.tokens(doc.sample_id, off + a, off + b))
        lab = dataset.tokens(doc.sample_id, off + a + 1, off + min(b + 1, doc.length))
        if b == doc.length:  # the document's last token has no target
            lab = torch.cat([lab, torch.tensor([IGNORE_INDEX], dtype=torch.long)])
        labels.append(lab)
        pos.append(torch.arange(a, b, dtype=torch.long))
    if ids:
        tensors = (torch.cat(ids), torch.cat(labels), torch.cat(pos))
    else:
        empty = torch.empty(0, dtype=torch.long)
        tensors = (empty, empty.clone(), empty.clone())
    return MicroBatch(*tensors, plan=plan, layout=plan.layout(bf16_grad_comm))


class GlobalBatchSampler:
    """Deterministic, resumable global batches: shuffled sequence ids, filled to a token budget.

    Each epoch permutes all sequence ids with ``seed + epoch``; a global batch takes the next ids
    until adding one more would exceed ``tokens_per_batch`` (a batch always holds at least one
    sequence). State: (epoch, offset).
    """

    def __init__(self, lengths: Sequence[int], tokens_per_batch: int, seed: int = 0) -> None:
        if tokens_per_batch <= 0:
            raise ValueError(f"GlobalBatchSampler: tokens_per_batch must be positive, got {tokens_per_batch}")
        if len(lengths) == 0:
            raise ValueError("GlobalBatchSampler: the dataset is empty")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.budget = int(tokens_per_batch)
        self.seed = int(seed)
        self.epoch = 0
        self.offset = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(len(self.lengths))

    def next_batch(self) -> List[int]:
        out: List[int] = []
        total = 0
        while True:
            if self.offset >= len(self._perm):
                self.epoch += 1
                self.offset = 0
                self._perm = self._permutation(self.epoch)
                if out:
                    break
            sid = int(self._perm[self.offset])
            n = int(self.lengths[sid])
            if out and total + n > self.budget:
                break
            out.append(sid)
            total += n
            self.offset += 1
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"GlobalBatchSampler: checkpoint seed {state['seed']} != {self.seed}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._perm = self._permutation(self.epoch)


def _unit_map(units: Any, world_size: int) -> Tuple[UnitMap, Any]:
    """The loader's HDP units and the job's ParallelDims (None for a bare UnitMap): a UnitMap, a
    bytescale Mesh's, the current mesh's, or one rank each."""
    if units is None:
        from ..comm.mesh import current_mesh

        units = current_mesh() or UnitMap.identity(world_size)
    dims = None if isinstance(units, UnitMap) else getattr(units, "dims", None)
    units = getattr(units, "units", units) if not isinstance(units, UnitMap) else units
    if not isinstance(units, UnitMap):
        raise TypeError(f"HDPLoader: units must be a bytescale.planner.UnitMap or a bytescale.Mesh, "
                        f"got {type(units).__name__}")
    if any(r >= world_size for r in units.ranks):
        raise ValueError(f"HDPLoader: the unit map {units.describe()} names ranks beyond the world of {world_size}")
    return units, dims


def _plan_fingerprint(specs_by_rank_digest: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(specs_by_rank_digest, digest_size=8).digest(), "little") >> 1


class HDPLoader:
    """Iterate HDP steps for this rank (see module docstring).

    Args:
        source: a :class:`~bytescale.data.source.BatchSource` (e.g. a data-service client), or a
            :class:`~bytescale.data.dataset.TokenDataset` (wrapped in a
            :class:`~bytescale.data.source.DatasetSource` with the config's batch size and seed).
        planner: how steps are planned (:class:`~bytescale.config.PlannerConfig`).
        config: batch size, seed, prefetch, plan check (:class:`~bytescale.config.LoaderConfig`).
        rank, world_size: this rank and the HDP world (default: torch.distributed's).
        runtime: ``bf16_grad_comm`` of the layouts (:class:`~bytescale.config.RuntimeConfig`).
        units: the HDP units to plan (a :class:`~bytescale.planner.UnitMap`, or a
            :class:`bytescale.Mesh`; default: the mesh of :func:`bytescale.init_mesh` if one was
            made, else one rank per unit). Every TP rank of a unit gets the unit's micro-batches in
            the same order, each ring over the ranks of its own TP index.
    """

    def __init__(
        self,
        source: Union[BatchSource, TokenDataset],
        planner: PlannerConfig,
        config: LoaderConfig,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        runtime: Optional[RuntimeConfig] = None,
        units: Optional[Any] = None,
    ) -> None:
        import torch.distributed as dist

        if not isinstance(planner, PlannerConfig):
            raise TypeError(f"HDPLoader: planner must be a bytescale.config.PlannerConfig, got {type(planner).__name__}")
        if not isinstance(config, LoaderConfig):
            raise TypeError(f"HDPLoader: config must be a bytescale.config.LoaderConfig, got {type(config).__name__}")
        self._own_source = not isinstance(source, BatchSource)
        self.planner = planner
        self.config = config
        self.runtime = runtime or RuntimeConfig()
        self.rank = dist.get_rank() if rank is None else int(rank)
        self.world_size = dist.get_world_size() if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"HDPLoader: rank {self.rank} outside [0, {self.world_size})")
        self.units, self.dims = _unit_map(units, self.world_size)
        if self.dims is not None:  # the pipeline depth is the mesh's (bytescale/parallel_dims.py)
            if planner.pp not in (1, self.dims.pp):
                raise ValueError(f"HDPLoader: PlannerConfig(pp={planner.pp}) contradicts the mesh's pp={self.dims.pp} "
                                 f"({self.dims.describe()}); the depth is the mesh's: leave PlannerConfig.pp at 1")
            self.planner = planner = replace(planner, pp=self.dims.pp)
        if self.rank not in self.units:
            raise ValueError(f"HDPLoader: rank {self.rank} is in no HDP unit of {self.units.describe()}")
        # documents no plan of this mesh can hold: found now, handled as config.oversize says
        self.limit = longest_document(planner, self.units)
        self._stream: Optional[StreamingOversize] = None
        if self._own_source:
            source = DatasetSource(source, config.tokens_per_batch, config.seed, self.limit, config.oversize)
        elif isinstance(source, DatasetSource):
            if source.max_length is None and not source.step:
                source.set_limit(self.limit, config.oversize)
            else:
                self._check_longest(source)
        else:
            self._stream = open_stream(source, self.limit, config.oversize)
        self.source: BatchSource = source
        self.step_index = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if config.prefetch else None
        self._pending: Optional[concurrent.futures.Future] = None
        self._pending_state: Optional[Dict[str, Any]] = None

    def _check_longest(self, source: DatasetSource) -> None:
        if source.longest > self.limit:
            raise ValueError(
                f"HDPLoader: this run's documents (or pieces) are up to {source.longest} tokens (it cut them at "
                f"{source.max_length}), more than the {self.limit} a plan of {self.units.num_units} HDP units at "
                f"capacity {self.planner.capacity} can hold; resume with a capacity of at least "
                f"{-(-source.longest // self.units.num_units)} tokens per unit (or on more units)")

    # -- state ---------------------------------------------------------------------------------
    def _state(self) -> Dict[str, Any]:
        state = {"source": self.source.state_dict(), "step": self.step_index}
        if self._stream is not None:
            state["oversize_limit"] = self._stream.limit
        return state

    def state_dict(self) -> Dict[str, Any]:
        """Position of the NEXT step to be returned (prefetched work is not part of the state), and
        the document limit the run started with (it shapes the batches)."""
        if self._pending_state is not None:
            return dict(self._pending_state)
        return self._state()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "source" not in state or "step" not in state:
            raise ValueError(f"HDPLoader.load_state_dict: expected keys 'source' and 'step', got {sorted(state)}")
        self._drop_pending()
        self.source.load_state_dict(state["source"])
        if isinstance(self.source, DatasetSource):
            self._check_longest(self.source)
        if self._stream is not None and "oversize_limit" in state:
            self._stream.resume_limit(int(state["oversize_limit"]), self.limit)
        self.step_index = int(state["step"])

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending.result()
        self._pending = None
        self._pending_state = None

    # -- steps ---------------------------------------------------------------------------------
    def _build(self, step_index: int, batch: GlobalBatch, offsets: Optional[Tuple[int, ...]] = None) -> Step:
        sample_ids, lengths = list(batch.sample_ids), [int(n) for n in batch.lengths]
        plan = self.planner.plan(lengths, self.units if not self.units.is_identity else self.units.num_units)
        plan.dims = self.dims  # planned for the mesh's dims: the executor compares them with its own
        mine = plan.micro_batches(self.rank, sample_ids)  # the executor's schedule orders them
        bf16 = self.runtime.bf16_grad_comm
        micro = tuple(materialize(self.source, mb, bf16, offsets) for mb in mine)
        gl_tokens = int(sum(lengths))
        step = Step(step_index, tuple(sample_ids), gl_tokens, gl_tokens - len(lengths), micro, plan, batch=batch)
        # the units relative to their first rank: every pipeline stage plans the same layout over
        # its own ranks, and the plan check compares the stages too
        base = min(self.units.ranks)
        units = [[r - base for r in unit] for unit in self.units.to_list()]
        step.info["fingerprint"] = _plan_fingerprint(
            repr((list(sample_ids), lengths, self.world_size, units)).encode() + bytes(plan.to_bytes()))
        return step

    def _next_batch(self) -> Tuple[int, GlobalBatch, Optional[Tuple[int, ...]], Dict[str, Any]]:
        """Take the next batch's metadata; returns (step index, batch, per document its offset in
        the drawn one or None, loader state BEFORE it)."""
        before = self._state()
        idx = self.step_index
        batch, offsets = self.source.next_batch(), None
        while self._stream is not None:
            batch, offsets = self._stream.apply(batch)
            if batch.sample_ids:
                break
            batch = self.source.next_batch()  # every document of it was left out
        self.step_index += 1
        return idx, batch, offsets, before

    def _verify(self, step: Step) -> None:
        import torch.distributed as dist

        if not (self.config.check_plan and dist.is_initialized()):
            return
        mine = step.info["fingerprint"]
        from .. import _C
        from ..comm import agree

        if _C.comm.has_world_transport("cpu"):
            # The agreement primitive (the same exchange as the collective and ring checks): every
            # rank sees every rank's fingerprint and raises the same error.
            rows = agree([mine], f"HDPLoader plan check of step {step.index}", kind="plan")
            bad = [r for r, row in enumerate(rows) if row[0] != rows[0][0]]
            if bad:
                raise RuntimeError(
                    f"HDPLoader: step {step.index}: ranks planned different global batches (rank "
                    f"{bad[0]} fingerprint {rows[bad[0]][0]:#x}, rank 0 {rows[0][0]:#x}); dataset, "
                    "seed, tokens_per_batch, world size and planner options must match on every rank"
                )
            return
        fp = torch.tensor([mine, -mine], dtype=torch.long)
        dist.all_reduce(fp, op=dist.ReduceOp.MAX)
        if int(fp[0]) != step.info["fingerprint"] or -int(fp[1]) != step.info["fingerprint"]:
            raise RuntimeError(
                f"HDPLoader: step {step.index}: ranks planned different global batches (rank "
                f"{self.rank} fingerprint {step.info['fingerprint']:#x}); dataset, seed, "
                "tokens_per_batch, world size and planner options must match on every rank"
            )

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        if self.config.max_steps is not None and self.step_index >= self.config.max_steps and self._pending is None:
            raise StopIteration
        if self._pending is not None:
            step = self._pending.result()
            self._pending = None
            self._pending_state = None
        else:
            idx, batch, offsets, _ = self._next_batch()
            step = self._build(idx, batch, offsets)
        if self._pool is not None and (self.config.max_steps is None or self.step_index < self.config.max_steps):
            idx, batch, offsets, before = self._next_batch()
            # state_dict() while the next step is in flight reports the position BEFORE it.
            self._pending_state = before
            self._pending = self._pool.submit(self._build, idx, batch, offsets)
        self._verify(step)
        return step

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown()
        if self._own_source:
            self.source.close()
