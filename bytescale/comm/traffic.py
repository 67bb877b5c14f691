"""What this process's transports moved, counted in C++ (``csrc/comm/traffic.h``).

The counters are exact and independent of the machine's speed or load: ring attention's K/V blocks
(forward, and again in the backward) and dK/dV accumulators are counted by the transport's ring
step (bytes sent and received, one step per exchange); every collective's payload (its input bytes
as sent, its output bytes as received) is counted by the collective front end under the purpose
of the calling thread (:func:`traffic_scope`; HybridDataParallel's gradient buckets are
``grad_sync``), else ``other``. ``ring_wait_s`` is the time ring attention blocked in a ring
exchange's ``wait()`` (on CUDA the wait only orders streams: host time, near zero). ``peers`` is the
number of distinct point-to-point peers (per transport: per communicator on CUDA) this process has
sent tensor data to or received it from since it started (ring steps, send / recv, dynamic groups'
ring steps and chunked broadcasts; not agreement digests or barrier tokens): what NCCL keeps
point-to-point buffers for, for good (NCCL issue #2294), so it is cumulative and ``reset=True``
leaves it (:func:`reset_peers` clears it). Under the planner's peer budget K (default 4) ring
attention alone gives every rank at most K.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, Tuple

from .. import _C

__all__ = ["PURPOSES", "Traffic", "reset_peers", "traffic", "traffic_scope"]

PURPOSES = ("ring_kv_fwd", "ring_kv_bwd", "ring_dkv_bwd", "grad_sync", "other")


@dataclass(frozen=True)
class Traffic:
    """One snapshot: per purpose (:data:`PURPOSES`) bytes sent, bytes received and operations
    (ring steps for the ring purposes, collectives otherwise), and the ring waiting time."""

    rows: Dict[str, Tuple[int, int, int]]
    ring_wait_s: float
    peers: int = 0  # distinct point-to-point peers so far (cumulative: not reset with the counters)

    def sent(self, purpose: str) -> int:
        return self.rows[purpose][0]

    def received(self, purpose: str) -> int:
        return self.rows[purpose][1]

    def ops(self, purpose: str) -> int:
        return self.rows[purpose][2]

    @property
    def ring_bytes(self) -> int:
        """Bytes this rank sent for ring attention (K/V forward and backward, dK/dV)."""
        return sum(self.sent(p) for p in PURPOSES[:3])

    @property
    def ring_steps(self) -> int:
        """Ring steps this rank ran (forward and backward K/V exchanges)."""
        return self.ops("ring_kv_fwd") + self.ops("ring_kv_bwd")


def traffic(reset: bool = False) -> Traffic:
    """This process's counters; ``reset=True`` restarts them from zero (the trainer does, per step)."""
    raw = _C.comm.traffic_snapshot(reset)
    wait_ns = raw.pop("ring_wait_ns")
    peers = int(raw.pop("peers"))
    return Traffic(rows={k: tuple(int(x) for x in v) for k, v in raw.items()}, ring_wait_s=wait_ns * 1e-9,
                   peers=peers)


def reset_peers() -> None:
    """Forget the point-to-point peers counted so far (:attr:`Traffic.peers`)."""
    _C.comm.reset_traffic_peers()


@contextlib.contextmanager
def traffic_scope(purpose: str) -> Iterator[None]:
    """Count the collectives this thread issues inside the block under ``purpose``."""
    prev = _C.comm.set_traffic_scope(purpose)
    try:
        yield
    finally:
        _C.comm.set_traffic_scope(prev)
