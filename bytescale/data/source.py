"""The contract between data sources and the HDP loader: global-batch metadata and token pulls.

Every training rank runs its own :class:`BatchSource` client. :meth:`BatchSource.next_batch`
returns the next global batch's METADATA only (stable sample ids, lengths, source of each): it is
identical on every rank, so every rank can plan the batch by itself. The rank then calls
:meth:`BatchSource.tokens` for exactly the token ranges its plan assigns to it (plus one label
token past each range) and never holds the whole global batch. ``state_dict()`` is the position of
the next batch and does not depend on the world size: a run saved at N ranks resumes at M ranks
with the same sequence of global batches.

Implementations: :class:`DatasetSource` (an in-memory :class:`~bytescale.data.dataset.TokenDataset`
or a :class:`~bytescale.data.token_store.TokenStore`, same batches as
:class:`~bytescale.data.loader.GlobalBatchSampler`) and the data service's clients
(:mod:`bytescale.data.service`, local processes or Ray actors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Protocol, Tuple, runtime_checkable

import torch

from .dataset import TokenDataset

__all__ = ["GlobalBatch", "BatchSource", "DatasetSource"]


@dataclass(frozen=True)
class GlobalBatch:
    """Metadata of one global batch.

    Attributes:
        step: index of the batch in the run (0, 1, ...).
        sample_ids: stable dataset-wide document ids (int64), in batch order.
        lengths: tokens of each document in this batch (a length curriculum may cut a document;
            ``tokens(i, a, b)`` is valid for ``0 <= a <= b <= length``).
        sources: index in the mixing spec of each document's source (0 for a single dataset).
    """

    step: int
    sample_ids: Tuple[int, ...]
    lengths: Tuple[int, ...]
    sources: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.sample_ids) == len(self.lengths) == len(self.sources)):
            raise ValueError(f"GlobalBatch: {len(self.sample_ids)} ids, {len(self.lengths)} lengths, "
                             f"{len(self.sources)} sources")

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))


@runtime_checkable
class BatchSource(Protocol):
    """What the loader consumes (one client per rank; all return identical metadata)."""

    def next_batch(self) -> GlobalBatch:
        """The next global batch's metadata (no tokens)."""
        ...

    def tokens(self, sample_id: int, start: int, end: int) -> torch.Tensor:
        """int64 token ids ``[start, end)`` of one document, pulled from whoever holds it."""
        ...

    def state_dict(self) -> Dict[str, Any]:
        """Position of the NEXT batch; independent of world size and worker count."""
        ...

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next batch is the one that followed it."""
        ...

    def close(self) -> None:
        """Release connections and mappings (idempotent)."""
        ...


class DatasetSource:
    """A :class:`BatchSource` over a :class:`~bytescale.data.dataset.TokenDataset`.

    Batches are those of :class:`~bytescale.data.loader.GlobalBatchSampler` with the same seed
    (shuffled ids per epoch, filled to ``tokens_per_batch``); ``sources`` are all 0.
    """

    def __init__(self, dataset: TokenDataset, tokens_per_batch: int, seed: int = 0) -> None:
        from .loader import GlobalBatchSampler

        self.dataset = dataset
        lengths = getattr(dataset, "lengths", None)
        if lengths is None:
            lengths = [dataset.length(i) for i in range(len(dataset))]
        self.sampler = GlobalBatchSampler(lengths, tokens_per_batch, seed)
        self.step = 0

    def next_batch(self) -> GlobalBatch:
        ids = self.sampler.next_batch()
        lengths = self.sampler.lengths[ids].tolist()
        batch = GlobalBatch(self.step, tuple(ids), tuple(int(n) for n in lengths), (0,) * len(ids))
        self.step += 1
        return batch

    def tokens(self, sample_id: int, start: int, end: int) -> torch.Tensor:
        return self.dataset.tokens(sample_id, start, end)

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "dataset", "step": self.step, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("kind") != "dataset":
            raise ValueError(f"DatasetSource: not a DatasetSource state (kind {state.get('kind')!r})")
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])

    def close(self) -> None:
        pass
