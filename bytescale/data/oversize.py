"""Documents no plan of the mesh can hold, handled as :attr:`bytescale.config.LoaderConfig.oversize` says.

The limit is the planner's own rule (:func:`bytescale.planner.longest_document`): every document of
at most ``limit`` tokens can be planned over the mesh's HDP units, one of ``limit + 1`` may not.

* A dataset or token store is checked before the first step, in one numpy pass over its lengths:
  :class:`DocumentView` cuts longer documents into consecutive pieces (``"split"``: ids are piece
  ids, no token dropped) or leaves them out (``"skip"``); ``"error"`` refuses with
  :class:`OversizeError`, naming the count and the first documents.
* Streaming sources (the data service: raw text tokenized on the fly) cannot look ahead:
  :class:`StreamingOversize` applies the option to each drawn document (pieces stay in the batch
  that drew the document, one after another), logs each document once with its source and id, and
  never ends the run.

The limit is part of the data (a piece's length depends on it): the loader keeps the one its run
started with in its state, so a run resumed on another world size sees the same global batches.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from .source import GlobalBatch

__all__ = ["DocumentView", "OversizeError", "StreamingOversize", "dataset_lengths", "describe_oversize",
           "open_stream"]

log = logging.getLogger("bytescale.data.oversize")

FIRST = 5  # documents an error message names


class OversizeError(ValueError):
    """Documents longer than any plan of the mesh can hold, with ``LoaderConfig(oversize="error")``."""


def dataset_lengths(dataset: Any) -> np.ndarray:
    """The lengths of every document of a dataset (its ``lengths`` array when it has one: a token
    store's index, no per-document call)."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        lengths = [dataset.length(i) for i in range(len(dataset))]
    return np.asarray(lengths, dtype=np.int64)


def describe_oversize(ids: np.ndarray, lengths: np.ndarray, limit: int, where: str) -> str:
    """'N documents of <where> are longer than ...: id (len), ...' for the first few."""
    first = ", ".join(f"{int(i)} ({int(n)} tokens)" for i, n in zip(ids[:FIRST], lengths[:FIRST]))
    more = f", ... ({len(ids) - FIRST} more)" if len(ids) > FIRST else ""
    return (f"{len(ids)} document{'s' if len(ids) != 1 else ''} of {where} {'are' if len(ids) != 1 else 'is'} "
            f"longer than the {limit} tokens a plan of this mesh can hold: {first}{more}")


FIX_HINT = ("; choose LoaderConfig(oversize='split') to cut them into pieces or 'skip' to leave them out, or "
            "plan for longer documents (raise PlannerConfig.capacity, run on more ranks, or offload)")


class DocumentView:
    """A token dataset seen through two length rules (ids are the view's; every kept token is read
    from the base dataset):

    * ``length_scale`` < 1 keeps the first ``ceil(length x scale)`` tokens of each document: the
      corpus' length distribution, shifted down, at CPU scale (like the synthetic corpus' 1/512);
    * documents longer than ``max_length`` are cut into consecutive pieces of at most
      ``max_length`` tokens, no token dropped (``oversize="split"``), or left out (``"skip"``), or
      refused (``"error"``: :class:`OversizeError` naming the count and the first documents).

    View ids follow the base order (a split document's pieces one after another). Building the
    view costs one pass over the lengths and one lengths array: only the long documents are
    remembered, and :meth:`locate` maps a view id to (base document, offset) in O(log long ones).
    """

    def __init__(self, base: Any, max_length: int, length_scale: float = 1.0, oversize: str = "split",
                 lengths: Optional[np.ndarray] = None) -> None:
        if max_length < 1:
            raise ValueError(f"DocumentView: max_length must be >= 1, got {max_length}")
        if oversize not in ("split", "skip", "error"):
            raise ValueError(f"DocumentView: oversize {oversize!r} is not split, skip or error")
        lens = dataset_lengths(base) if lengths is None else np.asarray(lengths, dtype=np.int64)
        if length_scale < 1.0:
            lens = np.maximum(1, np.ceil(lens * length_scale)).astype(np.int64)
        self.oversize_ids = np.flatnonzero(lens > max_length)
        long_lens = lens[self.oversize_ids]
        if oversize == "error" and len(self.oversize_ids):
            raise OversizeError(describe_oversize(self.oversize_ids, long_lens, max_length,
                                                  type(base).__name__) + FIX_HINT)
        if oversize == "skip" and len(self.oversize_ids) == len(lens):
            raise OversizeError(describe_oversize(self.oversize_ids, long_lens, max_length,
                                                  type(base).__name__) + ": oversize='skip' leaves nothing")
        self.base = base
        self.max_length = int(max_length)
        # per long document: its pieces (0 when skipped) and the view id of its first piece
        self._pieces = -(-long_lens // max_length) if oversize == "split" else np.zeros_like(long_lens)
        self._first = self.oversize_ids + np.concatenate([[0], np.cumsum(self._pieces - 1)[:-1]]).astype(np.int64)
        if not len(self.oversize_ids):
            self.lengths = lens
        elif oversize == "split":
            k = np.arange(int(self._pieces.max()))
            extra = [np.minimum(n - k[1:p] * max_length, max_length) for n, p in zip(long_lens, self._pieces)]
            self.lengths = np.insert(np.minimum(lens, max_length), np.repeat(self.oversize_ids + 1, self._pieces - 1),
                                     np.concatenate(extra)).astype(np.int64)
        else:
            self.lengths = np.delete(lens, self.oversize_ids)

    def __len__(self) -> int:
        return len(self.lengths)

    def length(self, idx: int) -> int:
        return int(self.lengths[idx])

    def locate(self, idx: int) -> Tuple[int, int]:
        """(base document, offset there) of view id ``idx``."""
        if not 0 <= idx < len(self.lengths):
            raise IndexError(f"DocumentView: id {idx} outside [0, {len(self.lengths)})")
        j = int(np.searchsorted(self._first, idx, side="right")) - 1
        if j < 0:
            return idx, 0
        if idx < self._first[j] + self._pieces[j]:
            return int(self.oversize_ids[j]), int(idx - self._first[j]) * self.max_length
        return int(idx - self._first[j] - self._pieces[j] + self.oversize_ids[j] + 1), 0

    @property
    def doc(self) -> np.ndarray:
        """Every view id's base document (an array as long as the view; for inspection)."""
        return np.array([self.locate(i)[0] for i in range(len(self))], dtype=np.int64)

    @property
    def start(self) -> np.ndarray:
        """Every view id's offset in its base document (for inspection)."""
        return np.array([self.locate(i)[1] for i in range(len(self))], dtype=np.int64)

    def tokens(self, idx: int, start: int, end: int) -> torch.Tensor:
        doc, off = self.locate(int(idx))
        return self.base.tokens(doc, off + start, off + end)


class StreamingOversize:
    """Applies the oversize option to each drawn global batch of a streaming source.

    ``apply(batch)`` returns the batch with every document longer than ``limit`` cut into
    consecutive pieces (same sample id and source, one after another, each with its offset in the
    document) or left out; each such document is logged once (source name and sample id).
    ``counts`` says how many were split and left out.
    """

    def __init__(self, limit: int, mode: str, source_names: Optional[Sequence[str]] = None) -> None:
        self.limit = int(limit)
        self.mode = mode
        self.names = list(source_names) if source_names else None
        self.counts: Dict[str, int] = {"split": 0, "skipped": 0}
        self._logged: set = set()

    def resume_limit(self, recorded: int, mesh_limit: int) -> None:
        """Cut at the limit the run started with (the same batches), unless this mesh holds less."""
        if recorded > mesh_limit:
            log.warning("the run cut long documents at %d tokens; this mesh holds %d: documents longer than %d "
                        "are cut at %d from here on (their batches differ from the uninterrupted run's)",
                        recorded, mesh_limit, mesh_limit, mesh_limit)
        self.limit = min(int(recorded), int(mesh_limit))

    def _name(self, source: int) -> str:
        if self.names and 0 <= source < len(self.names):
            return f"source {self.names[source]!r}"
        return f"source {source}"

    def apply(self, batch: GlobalBatch) -> Tuple[GlobalBatch, Optional[Tuple[int, ...]]]:
        """(the batch as planned, per document its offset in the drawn document, or None when no
        document was over the limit)."""
        if not batch.lengths or max(batch.lengths) <= self.limit:
            return batch, None
        ids, lens, srcs, offs = [], [], [], []
        for sid, n, s in zip(batch.sample_ids, batch.lengths, batch.sources):
            if n <= self.limit:
                ids.append(sid), lens.append(n), srcs.append(s), offs.append(0)
                continue
            key = (int(s), int(sid))
            first_time = key not in self._logged
            self._logged.add(key)
            if self.mode == "split":
                k = -(-n // self.limit)
                for j in range(k):
                    ids.append(sid), srcs.append(s), offs.append(j * self.limit)
                    lens.append(min(self.limit, n - j * self.limit))
                self.counts["split"] += 1
                if first_time:
                    log.warning("document %d of %s (%d tokens) is longer than the %d tokens a plan of this mesh "
                                "can hold: split into %d pieces", sid, self._name(s), n, self.limit, k)
            else:
                self.counts["skipped"] += 1
                if first_time:
                    (log.error if self.mode == "error" else log.warning)(
                        "document %d of %s (%d tokens) is longer than the %d tokens a plan of this mesh can hold: "
                        "skipped%s", sid, self._name(s), n, self.limit,
                        " (oversize='error' cannot refuse a streaming source's document before the run; the run "
                        "goes on)" if self.mode == "error" else "")
        out = GlobalBatch(batch.step, tuple(ids), tuple(lens), tuple(srcs))
        return out, tuple(offs)


def open_stream(source: Any, limit: int, mode: str) -> StreamingOversize:
    """The per-document handler of a streaming source. With ``"error"``, a source that declares its
    longest document (``source.longest``: a mixing spec's ``max_length`` bounds) above ``limit``
    is refused here, before the first step."""
    declared = getattr(source, "longest", None)
    if mode == "error" and declared and int(declared) > limit:
        raise OversizeError(f"the data source's documents may be up to {int(declared)} tokens (its spec's "
                            f"max_length), longer than the {limit} tokens a plan of this mesh can hold" + FIX_HINT)
    return StreamingOversize(limit, mode, getattr(source, "source_names", None))
