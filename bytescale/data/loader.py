"""The plan-driven HDP loader.

Per step it (1) takes the next global batch of sequence ids from a deterministic, resumable
sampler, (2) plans it with the C++ planner, and (3) materialises ONLY this rank's micro-batches:
input ids, labels, position ids and the attention layout.

Planning: every rank plans the same metadata deterministically (the planner is C++ and takes
milliseconds even for 16K ranks), which needs no broadcast and no central planner process; a
fingerprint of the plan is all-reduced once per step (MIN and MAX of a 63-bit hash) so ranks with
mismatched configurations fail with a clear error instead of deadlocking in a ring.

Token order inside a micro-batch: the local documents first (whole), then each sharded document's
two zig-zag chunks (chunk i, then chunk 2N-1-i for ring position i). Labels are the next token of
the SAME document: the label of a chunk's last token is the first token of the following chunk,
read directly from the dataset even when that chunk lives on another rank; the last token of a
document has no label. Position ids are positions inside the document (RoPE-correct for chunks).

The next step is prepared in a background thread while the current one trains. The loader's
state (sampler position, epoch, step) is checkpointable: a resumed run sees exactly the batches it
would have seen.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..loss import IGNORE_INDEX
from .dataset import TokenDataset

__all__ = ["SequenceSpec", "MicroBatchSpec", "MicroBatch", "Step", "GlobalBatchSampler", "HDPLoader",
           "materialize", "lockstep_schedule"]


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence in a micro-batch: whole (ring_size 1) or sharded over a ring."""

    seq_id: int
    length: int
    ring_size: int = 1
    ring_pos: int = 0


@dataclass
class MicroBatchSpec:
    """What the plan says one micro-batch of one rank holds."""

    local: List[SequenceSpec]
    sharded: List[SequenceSpec]
    group: Tuple[int, ...] = ()
    offload_ratio: float = 0.0

    @property
    def num_tokens(self) -> int:
        from .._zigzag import local_tokens

        return sum(s.length for s in self.local) + sum(
            local_tokens(s.length, s.ring_size, s.ring_pos) for s in self.sharded
        )


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    spec: MicroBatchSpec
    layout: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class Step:
    index: int
    seq_ids: List[int]
    global_tokens: int
    global_loss_tokens: int
    micro_batches: List[MicroBatch]
    plan: Any = None
    info: Dict[str, Any] = field(default_factory=dict)


def materialize(dataset: TokenDataset, spec: MicroBatchSpec,
                layout_factory: Optional[Callable[[MicroBatchSpec], Any]] = None) -> MicroBatch:
    """Read exactly this micro-batch's tokens (plus one label token per range) from the dataset."""
    from .._zigzag import chunk

    ids, labels, pos = [], [], []

    def add_range(sid: int, length: int, a: int, b: int) -> None:
        if b <= a:
            return
        ids.append(dataset.tokens(sid, a, b))
        nxt_end = min(b + 1, length)
        lab = dataset.tokens(sid, a + 1, nxt_end)
        if b == length:  # the document's last token has no target
            lab = torch.cat([lab, torch.tensor([IGNORE_INDEX], dtype=torch.long)])
        labels.append(lab)
        pos.append(torch.arange(a, b, dtype=torch.long))

    for s in spec.local:
        add_range(s.seq_id, s.length, 0, s.length)
    for s in spec.sharded:
        n = s.ring_size
        for c in (s.ring_pos, 2 * n - 1 - s.ring_pos):
            a, b = chunk(s.length, n, c)
            add_range(s.seq_id, s.length, a, b)
    if ids:
        mb = MicroBatch(torch.cat(ids), torch.cat(labels), torch.cat(pos), spec)
    else:
        empty = torch.empty(0, dtype=torch.long)
        mb = MicroBatch(empty, empty.clone(), empty.clone(), spec)
    if layout_factory is not None:
        mb.layout = layout_factory(spec)
    return mb


def lockstep_schedule(per_rank: List[List[MicroBatchSpec]]) -> List[List[MicroBatchSpec]]:
    """Align every rank's micro-batches into slots run in lockstep (for FSDP2-style training).

    With sharded parameters every rank joins a collective in every forward/backward, so all ranks
    must run micro-batch k together, and the members of a ring must meet in the same slot. Rings
    keep their relative order on every member (the plan's contract) and are placed in the earliest
    slot where all members are free; local micro-batches fill the remaining slots in order; every
    rank is padded with empty micro-batches to the same number of slots. Pure function of the plan:
    every rank computes the same schedule.
    """
    world = len(per_rank)
    ring_lists = [[(tuple(mb.group), tuple(s.seq_id for s in mb.sharded)) for mb in specs if mb.group]
                  for specs in per_rank]
    ring_specs = [{(tuple(mb.group), tuple(s.seq_id for s in mb.sharded)): mb for mb in specs if mb.group}
                  for specs in per_rank]
    heads = [0] * world
    next_free = [0] * world
    slots: List[dict] = [dict() for _ in range(world)]
    remaining = sum(len(r) for r in ring_lists)
    while remaining:
        progressed = False
        for r in range(world):
            if heads[r] >= len(ring_lists[r]):
                continue
            key = ring_lists[r][heads[r]]
            members = key[0]
            if all(heads[m] < len(ring_lists[m]) and ring_lists[m][heads[m]] == key for m in members):
                slot = max(next_free[m] for m in members)
                for m in members:
                    slots[m][slot] = ring_specs[m][key]
                    next_free[m] = slot + 1
                    heads[m] += 1
                remaining -= len(members)
                progressed = True
        if not progressed:
            raise RuntimeError("lockstep_schedule: ring micro-batches are not in one consistent order "
                               "across their members; the plan violates its ordering contract")
    for r in range(world):
        k = 0
        for mb in (m for m in per_rank[r] if not m.group):
            while k in slots[r]:
                k += 1
            slots[r][k] = mb
    total = max((max(sl) + 1 for sl in slots if sl), default=0)
    return [[slots[r].get(k, MicroBatchSpec(local=[], sharded=[])) for k in range(total)]
            for r in range(world)]


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


def _plan_fingerprint(specs_by_rank_digest: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(specs_by_rank_digest, digest_size=8).digest(), "little") >> 1


class HDPLoader:
    """Iterate HDP steps for this rank (see module docstring).

    Args:
        dataset: a :class:`~bytescale.data.dataset.TokenDataset`.
        plan_fn: ``plan_fn(lengths: list[int]) -> (plan, specs_for_rank)`` where
            ``specs_for_rank(rank) -> list[MicroBatchSpec]``; :func:`bytescale.data.hdp_plan_fn`
            builds one from the C++ planner.
        tokens_per_batch: global batch token budget.
        rank, world_size: this rank and the HDP world (default: torch.distributed's).
        layout_factory: builds the attention layout of a micro-batch spec.
        check_plan: all-reduce a fingerprint of the plan every step (needs an initialised
            process group).
        prefetch: prepare step k+1 in a background thread while step k trains.
        pad_micro_batches: run micro-batches in lockstep (:func:`lockstep_schedule`): every rank
            gets the same number of slots (empty micro-batches as padding) and ring members meet
            in the same slot, for sharded-parameter training (FSDP2) where every rank joins every
            forward's parameter all-gather.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        plan_fn: Callable[[List[int]], Tuple[Any, Callable[[int], List[MicroBatchSpec]]]],
        tokens_per_batch: int,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        seed: int = 0,
        layout_factory: Optional[Callable[[MicroBatchSpec], Any]] = None,
        check_plan: bool = True,
        prefetch: bool = True,
        max_steps: Optional[int] = None,
        pad_micro_batches: bool = False,
    ) -> None:
        import torch.distributed as dist

        self.dataset = dataset
        self.plan_fn = plan_fn
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.sampler = GlobalBatchSampler([dataset.length(i) for i in range(len(dataset))],
                                          tokens_per_batch, seed)
        self.layout_factory = layout_factory
        self.check_plan = check_plan
        self.prefetch = prefetch
        self.max_steps = max_steps
        self.pad_micro_batches = pad_micro_batches
        self.step_index = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if prefetch else None
        self._pending: Optional[concurrent.futures.Future] = None
        self._pending_state: Optional[Dict[str, Any]] = None

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Position of the NEXT step to be returned (prefetched work is not part of the state)."""
        if self._pending_state is not None:
            return dict(self._pending_state)
        return {"sampler": self.sampler.state_dict(), "step": self.step_index}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._drop_pending()
        self.sampler.load_state_dict(state["sampler"])
        self.step_index = int(state["step"])

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending.result()
        self._pending = None
        self._pending_state = None

    # -- steps ---------------------------------------------------------------------------------
    def _build(self, step_index: int, seq_ids: List[int]) -> Step:
        lengths = [self.dataset.length(s) for s in seq_ids]
        plan, specs_for_rank = self.plan_fn(lengths)
        if self.pad_micro_batches:
            specs = lockstep_schedule([specs_for_rank(r) for r in range(self.world_size)])[self.rank]
        else:
            specs = specs_for_rank(self.rank)
        # The plan works on positions in the batch; map to dataset ids.
        for mb in specs:
            mb.local = [SequenceSpec(seq_ids[s.seq_id], s.length, s.ring_size, s.ring_pos) for s in mb.local]
            mb.sharded = [SequenceSpec(seq_ids[s.seq_id], s.length, s.ring_size, s.ring_pos) for s in mb.sharded]
        micro = [materialize(self.dataset, mb, self.layout_factory) for mb in specs]
        gl_tokens = int(sum(lengths))
        step = Step(step_index, list(seq_ids), gl_tokens, gl_tokens - len(lengths), micro, plan)
        plan_bytes = plan.to_bytes() if hasattr(plan, "to_bytes") else repr(plan).encode()
        step.info["fingerprint"] = _plan_fingerprint(
            repr((seq_ids, lengths, self.world_size)).encode() + bytes(plan_bytes))
        return step

    def _next_ids(self) -> Tuple[int, List[int], Dict[str, Any]]:
        """Take the next batch's ids; returns (step index, ids, loader state BEFORE taking it)."""
        before = {"sampler": self.sampler.state_dict(), "step": self.step_index}
        idx = self.step_index
        ids = self.sampler.next_batch()
        self.step_index += 1
        return idx, ids, before

    def _verify(self, step: Step) -> None:
        import torch.distributed as dist

        if not (self.check_plan and dist.is_initialized()):
            return
        fp = torch.tensor([step.info["fingerprint"], -step.info["fingerprint"]], dtype=torch.long)
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
        if self.max_steps is not None and self.step_index >= self.max_steps and self._pending is None:
            raise StopIteration
        if self._pending is not None:
            step = self._pending.result()
            self._pending = None
            self._pending_state = None
        else:
            idx, ids, _ = self._next_ids()
            step = self._build(idx, ids)
        if self._pool is not None and (self.max_steps is None or self.step_index < self.max_steps):
            idx, ids, before = self._next_ids()
            # state_dict() while the next step is in flight reports the position BEFORE it.
            self._pending_state = before
            self._pending = self._pool.submit(self._build, idx, ids)
        self._verify(step)
        return step

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown()
