"""The trainer's own dataset as HDP documents, and the train "data loader" that yields HDP steps.

:class:`HFDocuments` reads a tokenized dataset the way transformers' ``Trainer`` and TRL's
``SFTTrainer`` hold it (a ``datasets.Dataset``, or any sized sequence of dicts): ``input_ids``
per row, optionally ``labels`` (HF's unshifted labels, ``-100`` where a token is no target: TRL's
completion-only and assistant-only masks end up there), ``attention_mask`` (padding is cut off:
a document is the row's contiguous run of ones) and ``seq_lengths`` (a row packed by TRL: each of
its documents is one HDP document again). Documents are taken as they come, never padded.

:class:`HDPTrainLoader` is what the trainer iterates: one item per optimizer step, an
:class:`HDPBatch` holding this rank's :class:`~bytescale.runtime.Step` of one global batch planned
across the ranks. It streams on across epochs (an epoch is the number of global batches of the
first pass over the data) and its position is checkpointable and independent of the world size.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from ..config import LoaderConfig, PlannerConfig, RuntimeConfig
from ..data.loader import GlobalBatchSampler, HDPLoader, materialize
from ..runtime.types import IGNORE_INDEX, Step

__all__ = ["HFDocuments", "HDPBatch", "HDPTrainLoader", "steps_per_epoch"]

_BATCH_ROWS = 512  # rows read at once when scanning a datasets.Dataset


def _columns(dataset: Any) -> Tuple[str, ...]:
    names = getattr(dataset, "column_names", None)
    if names is None:
        first = dataset[0]
        if not hasattr(first, "keys"):
            raise TypeError(f"HDP trainer: train_dataset rows must be dicts with 'input_ids', "
                            f"got {type(first).__name__}")
        names = list(first.keys())
    return tuple(names)


def _rows(dataset: Any, columns: Sequence[str]) -> Iterator[Dict[str, Any]]:
    """Every row's ``columns`` (batched reads for a ``datasets.Dataset``)."""
    if hasattr(dataset, "iter") and hasattr(dataset, "select_columns"):
        for batch in dataset.select_columns(list(columns)).iter(batch_size=_BATCH_ROWS):
            for j in range(len(batch[columns[0]])):
                yield {c: batch[c][j] for c in columns}
    else:
        for i in range(len(dataset)):
            row = dataset[i]
            yield {c: row[c] for c in columns}


class HFDocuments:
    """A :class:`~bytescale.data.TokenDataset` over a tokenized HF-style dataset (module docstring).

    Document ``i`` is ``lengths[i]`` tokens of row ``row[i]`` from offset ``offset[i]``;
    ``loss_tokens[i]`` counts its tokens that are a target (label != -100 at positions 1..n-1).
    """

    def __init__(self, dataset: Any, name: str = "train_dataset") -> None:
        cols = self.check(dataset, name)
        self.dataset = dataset
        self.has_labels = "labels" in cols
        wanted = [c for c in ("input_ids", "labels", "attention_mask", "seq_lengths") if c in cols]
        rows, offsets, lengths, loss = [], [], [], []
        for r, ex in enumerate(_rows(dataset, wanted)):
            n = len(ex["input_ids"])
            start, end = 0, n
            mask = ex.get("attention_mask")
            if mask is not None and n:
                keep = np.flatnonzero(np.asarray(mask))
                if len(keep) == 0:
                    continue  # an all-padding row holds no document
                start, end = int(keep[0]), int(keep[-1]) + 1
                if end - start != len(keep):
                    raise ValueError(f"HDP trainer: {name} row {r}: attention_mask has holes; a document must be "
                                     "one contiguous run of tokens")
            pieces = [int(x) for x in ex["seq_lengths"]] if ex.get("seq_lengths") is not None else [end - start]
            if sum(pieces) != end - start:
                raise ValueError(f"HDP trainer: {name} row {r}: seq_lengths sum to {sum(pieces)}, the row has "
                                 f"{end - start} tokens")
            labels = np.asarray(ex["labels"]) if self.has_labels else None
            if labels is not None and len(labels) != n:
                raise ValueError(f"HDP trainer: {name} row {r}: {len(labels)} labels for {n} input_ids")
            off = start
            for piece in pieces:
                if piece > 0:
                    rows.append(r)
                    offsets.append(off)
                    lengths.append(piece)
                    tgt = piece - 1 if labels is None else int((labels[off + 1:off + piece] != IGNORE_INDEX).sum())
                    loss.append(tgt)
                off += piece
        if not lengths:
            raise ValueError(f"HDP trainer: {name} holds no tokens")
        self.row = np.asarray(rows, dtype=np.int64)
        self.offset = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.loss_tokens = np.asarray(loss, dtype=np.int64)
        self._row = functools.lru_cache(maxsize=256)(self._read_row)  # a row serves several ranges

    def _read_row(self, r: int, column: str) -> torch.Tensor:
        return torch.as_tensor(np.asarray(self.dataset[r][column], dtype=np.int64))

    @staticmethod
    def check(dataset: Any, name: str = "train_dataset") -> Tuple[str, ...]:
        """What the planner needs of ``dataset`` (a length, tokenized rows); returns its columns."""
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__") \
                or type(dataset).__name__ == "IterableDataset":
            raise TypeError(f"HDP trainer: {name} must be a map-style dataset with a length (the planner needs every "
                            f"document's length up front), got {type(dataset).__name__}")
        if len(dataset) == 0:
            raise ValueError(f"HDP trainer: {name} is empty")
        cols = _columns(dataset)
        if "input_ids" not in cols:
            raise ValueError(f"HDP trainer: {name} must be tokenized (an 'input_ids' column); it has {list(cols)}")
        return cols

    def __len__(self) -> int:
        return len(self.lengths)

    def length(self, idx: int) -> int:
        return int(self.lengths[idx])

    def _range(self, column: str, idx: int, start: int, end: int) -> torch.Tensor:
        n = int(self.lengths[idx])
        if not 0 <= start <= end <= n:
            raise IndexError(f"HFDocuments: range [{start}, {end}) outside document {idx} of length {n}")
        off = int(self.offset[idx])
        return self._row(int(self.row[idx]), column)[off + start:off + end]

    def tokens(self, idx: int, start: int, end: int) -> torch.Tensor:
        """Token ids ``[start, end)`` of document ``idx``."""
        return self._range("input_ids", idx, start, end)

    def labels(self) -> Optional["_Labels"]:
        """The documents' HF labels as a token source (None when the dataset has no labels column)."""
        return _Labels(self) if self.has_labels else None


class _Labels:
    """Document ``i``'s HF labels in place of its tokens: materialising a micro-batch plan over this
    gives the micro-batch's targets (the label of position t is labels[t + 1], as for tokens)."""

    def __init__(self, docs: HFDocuments) -> None:
        self.docs = docs

    def tokens(self, idx: int, start: int, end: int) -> torch.Tensor:
        return self.docs._range("labels", idx, start, end)


class HDPBatch(dict):
    """One optimizer step's input for the trainer: this rank's tokens under ``"input_ids"`` (what the
    trainer counts for FLOPs and tokens seen) and the planned :class:`~bytescale.runtime.Step` as
    ``.step``."""

    def __init__(self, step: Step) -> None:
        ids = [mb.input_ids for mb in step.micro_batches]
        super().__init__(input_ids=torch.cat(ids) if ids else torch.empty(0, dtype=torch.long))
        self.step = step


def steps_per_epoch(lengths: Sequence[int], tokens_per_batch: int, seed: int) -> int:
    """Global batches in the first pass over ``lengths`` (the loader's sampler, no tokens read)."""
    sampler = GlobalBatchSampler(lengths, tokens_per_batch, seed)
    n = 0
    while sampler.epoch == 0:
        sampler.next_batch()
        n += 1
    return n


class HDPTrainLoader:
    """The trainer's train data loader under HDP (module docstring).

    Args:
        docs: the trainer's dataset as documents.
        planner, loader, runtime: as for :class:`bytescale.data.HDPLoader` (``loader.max_steps`` is
            ignored: the trainer stops at its own ``max_steps``).
    """

    def __init__(self, docs: HFDocuments, planner: PlannerConfig, loader: LoaderConfig,
                 runtime: Optional[RuntimeConfig] = None) -> None:
        self.docs = docs
        self.dataset = docs  # what Trainer.num_examples counts: documents
        self.config = loader
        self._labels = docs.labels()
        self.loader = HDPLoader(docs, planner, replace(loader, max_steps=None), runtime=runtime)
        self._len = steps_per_epoch(docs.lengths, loader.tokens_per_batch, loader.seed)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> "HDPTrainLoader":
        return self  # one stream across epochs: the position lives in the loader's state

    def __next__(self) -> HDPBatch:
        step = next(self.loader)
        if self._labels is not None:
            mbs = []
            for mb in step.micro_batches:
                targets = materialize(self._labels, mb.plan).labels  # labels[t + 1] of each token
                mbs.append(replace(mb, labels=targets))
            step.micro_batches = tuple(mbs)
            # every rank sums the same documents; a batch with no target at all trains on nothing
            # (zero loss and gradients, as HF's clamped division gives), not on a division by zero
            step.global_loss_tokens = max(1, int(self.docs.loss_tokens[list(step.sample_ids)].sum()))
        return HDPBatch(step)

    def state_dict(self) -> Dict[str, Any]:
        """Position of the next global batch (independent of the world size)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()
