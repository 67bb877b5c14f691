"""The cluster a step is simulated on: links, memory and peak speed of its devices.

A :class:`ClusterSpec` names what the simulator needs and nothing more: how many devices, how they
are grouped into nodes, the bandwidth and latency of a point-to-point transfer inside a node
(NVLink) and between nodes (one NIC per GPU), the device<->host copy bandwidth (activation
offloading), the device memory (the token capacity of a micro-batch) and the peak dense FLOP/s
(compute time and MFU). Bandwidths are bytes/s per direction per device, as NCCL's ``busbw``.

Presets (``--cluster NAME``; every number is a published or vendor figure, not fitted to any
result, see ``source``):

* ``h100-nvlink-ib400``: H100 SXM 80 GB, 8 per node, NVLink ~370 GB/s effective per direction for
  NCCL p2p, 400 Gb/s InfiniBand per GPU ~48 GB/s effective, pinned host copies ~50 GB/s (PCIe
  Gen5), 989 TFLOP/s dense bf16.
* ``cpu-gloo``: CPU processes on one machine talking Gloo over loopback TCP (the validation runs);
  its numbers are stated defaults that ``benchmarks/validate_sim.py`` replaces by measured ones.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional

__all__ = ["ClusterSpec", "CLUSTERS", "cluster"]


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster (see the module docstring for units)."""

    name: str
    gpus: int
    gpus_per_node: int
    intra_bw: float        # bytes/s per direction, point to point inside a node
    intra_latency: float   # s per transfer inside a node
    inter_bw: float        # bytes/s per direction per device between nodes
    inter_latency: float   # s per transfer between nodes
    host_bw: float         # bytes/s device<->host (min of d2h, h2d)
    gpu_memory: float      # bytes per device
    peak_flops: float      # dense FLOP/s of one device (bf16)
    loader_bw: float = 1e9  # bytes/s one node's data loader reads (data-stall model)
    compute_slowdown: float = 1.0  # >1 when devices share compute (CPU processes on fewer cores)
    # A measured price of ring micro-batches, per layer (0 = unset: priced by the cost model like
    # local ones). When any is set, a ring micro-batch of ring size d costs
    # ring_a1 x sum(s^2)/d + ring_b1 x its tokens + (ring_step_s + ring_doc_step_s x documents) x d
    # + ring_call_s instead of the cost model's a1, b1, g (benchmarks/validate_sim.py measures
    # them for the CPU ring kernel, in place with N processes).
    ring_a1: float = 0.0
    ring_b1: float = 0.0
    ring_step_s: float = 0.0
    ring_doc_step_s: float = 0.0
    ring_call_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("gpus", "gpus_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"cluster {self.name!r}: {f} must be an integer >= 1, got {v!r}")
        for f in ("intra_bw", "inter_bw", "host_bw", "gpu_memory", "peak_flops", "loader_bw"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0 and v < float("inf")):
                raise ValueError(f"cluster {self.name!r}: {f} must be a positive number, got {v!r}")
        for f in ("intra_latency", "inter_latency"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and 0 <= v < float("inf")):
                raise ValueError(f"cluster {self.name!r}: {f} must be >= 0, got {v!r}")
        for f in self.RING_FIELDS:
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and 0 <= v < float("inf")):
                raise ValueError(f"cluster {self.name!r}: {f} must be >= 0, got {v!r}")
        if not self.compute_slowdown >= 1.0:
            raise ValueError(f"cluster {self.name!r}: compute_slowdown must be >= 1, got {self.compute_slowdown!r}")

    RING_FIELDS = ("ring_a1", "ring_b1", "ring_step_s", "ring_doc_step_s", "ring_call_s")

    @property
    def measured_ring(self) -> bool:
        """Whether ring micro-batches have a measured price (the ``ring_*`` fields)."""
        return any(getattr(self, f) > 0 for f in self.RING_FIELDS)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def with_size(self, gpus: int, gpus_per_node: int) -> "ClusterSpec":
        """The same devices and links, ``gpus`` of them, ``gpus_per_node`` per node."""
        return replace(self, gpus=gpus, gpus_per_node=gpus_per_node)

    def scaled_bandwidth(self, factor: float) -> "ClusterSpec":
        """Every network bandwidth (intra, inter) multiplied by ``factor``."""
        return replace(self, intra_bw=self.intra_bw * factor, inter_bw=self.inter_bw * factor)

    def link(self, crosses_nodes: bool) -> tuple:
        """(bandwidth, latency) of a ring hop, inside a node or between nodes."""
        return (self.inter_bw, self.inter_latency) if crosses_nodes else (self.intra_bw, self.intra_latency)

    def allreduce_time(self, nbytes: float, ranks: int, ranks_per_node: Optional[int] = None) -> float:
        """Ring all-reduce (= reduce-scatter + all-gather) of ``nbytes`` over ``ranks`` devices:
        2(n-1)/n of the data crosses the slowest link (inter-node when the ranks span nodes), plus
        2(n-1) hop latencies (NCCL's ring algorithm; tree/NVLS variants are not modelled).
        ``ranks_per_node``: how many of the ranks share a node (default ``gpus_per_node``; with
        tensor parallelism, the HDP units per node: the all-reduce runs among one GPU per unit)."""
        if ranks <= 1:
            return 0.0
        crosses = ranks > (self.gpus_per_node if ranks_per_node is None else ranks_per_node)
        bw, lat = self.link(crosses)
        return 2.0 * (ranks - 1) / ranks * nbytes / bw + 2.0 * (ranks - 1) * lat


CLUSTERS: Dict[str, ClusterSpec] = {
    "h100-nvlink-ib400": ClusterSpec(
        name="h100-nvlink-ib400", gpus=1024, gpus_per_node=8,
        intra_bw=370e9, intra_latency=3e-6, inter_bw=48e9, inter_latency=10e-6,
        host_bw=50e9, gpu_memory=80e9, peak_flops=989e12, loader_bw=1e9,
        source="H100 SXM datasheet (989 TFLOP/s bf16 dense, 80 GB); NCCL p2p over NVLink ~370 GB/s; "
               "400 Gb/s IB ~48 GB/s effective per GPU; PCIe Gen5 pinned copies ~50 GB/s; latencies "
               "typical NCCL p2p figures; loader 1 GB/s per node a stated guess"),
    "cpu-gloo": ClusterSpec(
        name="cpu-gloo", gpus=4, gpus_per_node=4,
        intra_bw=1e9, intra_latency=100e-6, inter_bw=1e9, inter_latency=100e-6,
        host_bw=5e9, gpu_memory=8e9, peak_flops=0.1e12, loader_bw=1e9,
        source="stated defaults for Gloo over loopback TCP; validate_sim.py measures its own"),
}


def cluster(name: str, gpus: int, gpus_per_node: int) -> ClusterSpec:
    """The preset ``name`` resized to ``gpus`` devices, ``gpus_per_node`` per node."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(CLUSTERS)}")
    return CLUSTERS[name].with_size(gpus, gpus_per_node)
