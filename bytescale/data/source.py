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
from typing import Any, Dict, Optional, Protocol, Tuple, runtime_checkable

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

    ``max_length``: documents longer than this are handled as ``oversize`` says
    (:class:`~bytescale.data.oversize.DocumentView`: split into pieces, whose ids are then the
    batches' sample ids, skipped, or refused); :class:`~bytescale.data.HDPLoader` sets it to the
    longest document its plans can hold (:meth:`set_limit`). It is part of the state: a resumed
    source takes the one its run started with.
    """

    def __init__(self, dataset: TokenDataset, tokens_per_batch: int, seed: int = 0,
                 max_length: Optional[int] = None, oversize: str = "split") -> None:
        from .oversize import dataset_lengths

        self.base = dataset
        self.tokens_per_batch, self.seed = int(tokens_per_batch), int(seed)
        self.base_lengths = dataset_lengths(dataset)
        self.step = 0
        self.max_length: Optional[int] = None
        self.oversize = oversize
        self._view(max_length, oversize)

    def _view(self, max_length: Optional[int], oversize: str) -> None:
        from .loader import GlobalBatchSampler
        from .oversize import DocumentView

        over = max_length is not None and bool((self.base_lengths > max_length).any())
        self.dataset = (DocumentView(self.base, max_length, oversize=oversize, lengths=self.base_lengths)
                        if over else self.base)
        self.max_length, self.oversize = max_length, oversize
        self.sampler = GlobalBatchSampler(self.dataset.lengths if over else self.base_lengths,
                                          self.tokens_per_batch, self.seed)

    @property
    def longest(self) -> int:
        """The longest document (or piece) this source draws."""
        return int(self.sampler.lengths.max())

    def set_limit(self, max_length: int, oversize: str) -> None:
        """Handle documents longer than ``max_length`` as ``oversize`` says (before the first batch;
        :class:`~bytescale.data.oversize.OversizeError` for ``"error"`` when there are any)."""
        if self.step or self.sampler.epoch or self.sampler.offset:
            raise RuntimeError("DatasetSource.set_limit: batches were drawn already; set the limit first")
        self._view(int(max_length), oversize)

    def next_batch(self) -> GlobalBatch:
        ids = self.sampler.next_batch()
        lengths = self.sampler.lengths[ids].tolist()
        batch = GlobalBatch(self.step, tuple(ids), tuple(int(n) for n in lengths), (0,) * len(ids))
        self.step += 1
        return batch

    def tokens(self, sample_id: int, start: int, end: int) -> torch.Tensor:
        return self.dataset.tokens(sample_id, start, end)

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "dataset", "step": self.step, "sampler": self.sampler.state_dict(),
                "max_length": self.max_length, "oversize": self.oversize}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("kind") != "dataset":
            raise ValueError(f"DatasetSource: not a DatasetSource state (kind {state.get('kind')!r})")
        if "max_length" in state and (state["max_length"] != self.max_length
                                      or state.get("oversize", self.oversize) != self.oversize):
            # the documents the run started with (pieces depend on the limit)
            self._view(state["max_length"], state.get("oversize", self.oversize))
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])

    def close(self) -> None:
        pass
