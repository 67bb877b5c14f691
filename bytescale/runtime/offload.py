"""Selective activation offloading (ByteScale idea 4) through autograd's saved-tensor hooks.

    with bytescale.offload(ratio=0.5, seq_len=T):   # the micro-batch's offload ratio from the plan
        loss = model(input_ids, position_ids) ...
        loss.backward()

During forward, the saved activations whose first dimension is the micro-batch's token dimension
(``seq_len``; any leading size if None) and that are at least ``min_bytes`` large are split at pack
time, without copying: whole tensors go to a host-memory pool (the C++ engine,
csrc/offload/offload.cpp, off the compute thread) until ``ratio`` of their bytes went, in the order
they are saved (each one goes when that brings the share offloaded so far closest to ``ratio``);
the others stay in place untouched. An offloaded tensor's memory is freed once its copy is done and
forward drops it; in backward it comes back into ONE new tensor of its sizes and strides,
allocated for the consumer (no clone of kept rows, no concatenation: a tensor is a single
allocation, so offloading part of one would free nothing). A tensor saved by several ops (the normed
input of the q, k and v projections) is copied once. Backward fetches them in reverse order,
prefetching the next ``prefetch_depth`` ones while the current one is used.
Parameters and small tensors are never offloaded. Values are restored bit for bit, so gradients
are identical to training without offloading; the context composes with activation checkpointing
(non-reentrant) and with :class:`bytescale.HybridDataParallel`.

Copies run on a copy engine (csrc/offload/copy_engine.h): host-to-host on a worker thread on CPU;
on CUDA a pinned pool with per-device D2H and H2D streams and events (csrc/cuda/offload/). What
was verified where, and measured numbers: README "Status" and benchmarks/RESULTS.md.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .. import _C

__all__ = ["offload", "OffloadStats", "default_engine"]

_ENGINE: Optional["_C.offload.Engine"] = None


def default_engine() -> "_C.offload.Engine":
    """The process's shared engine (one host pool reused across steps)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = _C.offload.Engine(0)
    return _ENGINE


class _Handle:
    """What autograd saves for an offloaded tensor. Owned by the autograd graph alone (the context
    keeps weak references), so a step's restored activations are freed with its graph; a handle
    that dies unfetched (no backward ran) returns its engine entry and host buffer."""

    __slots__ = ("id", "tensor", "index", "engine", "__weakref__")

    def __init__(self, engine, hid: int, index: int) -> None:
        self.engine = engine
        self.id = hid
        self.index = index
        self.tensor: Optional[torch.Tensor] = None

    def __del__(self) -> None:
        if self.tensor is None and self.engine is not None:
            try:
                self.engine.discard(self.id)  # no-op for an entry already fetched
            except Exception:  # interpreter shutdown: nothing left to return it to
                pass


class OffloadStats:
    def __init__(self) -> None:
        self.offloaded_tensors = 0
        self.offloaded_bytes = 0  # bytes moved to the host pool
        self.kept_tensors = 0  # distinct saved tensors (parameters excluded) kept in place
        self.kept_bytes = 0  # bytes of saved activations that stayed in place (each tensor once)
        self.eligible_bytes = 0  # bytes of the distinct tensors that could go (the ratio's base)
        self.shared_tensors = 0  # saves of a tensor already offloaded (one copy serves all)


class offload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager offloading ``ratio`` of the bytes of the large saved activations, whole
    tensors at a time (see module doc)."""

    def __init__(self, ratio: float, seq_len: Optional[int] = None, min_bytes: int = 1 << 16,
                 prefetch_depth: int = 2, engine: Optional["_C.offload.Engine"] = None) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"offload: ratio must be in [0, 1], got {ratio}")
        self.ratio = float(ratio)
        self.seq_len = seq_len
        self.min_bytes = int(min_bytes)
        self.depth = int(prefetch_depth)
        self.engine = engine or default_engine()
        self.stats = OffloadStats()
        self._packed: List["weakref.ref[_Handle]"] = []
        # id(tensor) -> (weak tensor, its version, weak handle or None if kept in place): a tensor
        # saved by several ops (one input feeding the q, k and v projections) is offloaded and
        # counted once.
        self._by_id: Dict[int, Tuple["weakref.ref[torch.Tensor]", int,
                                     Optional["weakref.ref[_Handle]"]]] = {}
        super().__init__(self._pack, self._unpack)

    def _eligible(self, t: torch.Tensor) -> bool:
        if self.ratio == 0.0 or isinstance(t, nn.Parameter) or t.dim() == 0:
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        if self.seq_len is not None and t.shape[0] != self.seq_len:
            return False
        if not t.is_contiguous() and not _dense(t):
            return False  # expanded/overlapping views: their layout could not be restored
        return t.device.type in ("cpu", "cuda")

    def _saved_before(self, t: torch.Tensor):
        """(True, handle or None) if this very live tensor, unmodified, was saved before."""
        hit = self._by_id.get(id(t))
        if hit is None:
            return False, None
        t_ref, version, h_ref = hit
        if t_ref() is not t or version != t._version:
            return False, None
        return True, (h_ref() if h_ref is not None else None)

    def _pack(self, t: torch.Tensor):
        total = t.numel() * t.element_size()
        seen, h = self._saved_before(t)
        if not self._eligible(t):
            if not seen and not isinstance(t, nn.Parameter):
                self.stats.kept_tensors += 1
                self.stats.kept_bytes += total
                self._by_id[id(t)] = (weakref.ref(t), t._version, None)
            return t
        if h is not None:  # one copy serves every op that saved this tensor
            self.stats.shared_tensors += 1
            return h
        if seen:  # saved before and kept in place: it still is
            return t
        st = self.stats
        st.eligible_bytes += total
        if st.offloaded_bytes + total / 2 > self.ratio * st.eligible_bytes:
            st.kept_tensors += 1
            st.kept_bytes += total
            self._by_id[id(t)] = (weakref.ref(t), t._version, None)
            return t
        # The engine restores the exact sizes and strides (kernels such as BLAS may round
        # differently on another layout), so values and gradients are bit-identical.
        h = _Handle(self.engine, self.engine.offload(t.detach()), len(self._packed))
        self._packed.append(weakref.ref(h))
        self._by_id[id(t)] = (weakref.ref(t), t._version, weakref.ref(h))
        st.offloaded_tensors += 1
        st.offloaded_bytes += total
        return h

    def _unpack(self, x):
        if not isinstance(x, _Handle):
            return x
        if x.tensor is None:
            # first-in, last-out: the tensors packed just before this one are needed next
            for j in range(x.index - 1, max(-1, x.index - 1 - self.depth), -1):
                nxt = self._packed[j]()
                if nxt is not None and nxt.tensor is None:
                    self.engine.prefetch(nxt.id)
            x.tensor = self.engine.fetch(x.id)
        return x.tensor


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: a permutation of a contiguous layout (storage size == numel)."""
    if t.numel() == 0:
        return True
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return span == t.numel() and all(st > 0 for st in t.stride())
