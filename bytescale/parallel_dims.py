"""The parallel dimensions of a job, stated once: sizes, the rank grid, and what composes with what.

``ParallelDims(world, pp=, tp=, ep=, fsdp=, sp=)`` is torch-free (it imports nothing of torch or of
the extension): the mesh (:func:`bytescale.init_mesh`), the training entry point's options
(:class:`bytescale.config.ParallelConfig`) and a user laying out a job by hand all check their sizes
and combinations here, so a combination refused by one is refused by all, with the same words.

Layout: ``pp x hdp x tp`` with TP innermost; global rank ``(p * hdp + h) * tp + t`` is TP index ``t``
of HDP unit ``h`` of pipeline stage ``p`` (``hdp = world / (pp x tp)``). Expert parallelism groups
``ep`` consecutive HDP units of a stage; FSDP2 shards over the HDP dimension (the dense parameters
only, under expert parallelism); sequence parallelism
(``sp``) splits the norms' tokens over the TP ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

__all__ = ["ParallelDims", "check_composition", "REFUSED"]

# The one compatibility matrix: every pair of features that does not compose yet, and why. Empty
# today: pp, tp, ep, fsdp and sp all compose (tests/train/test_train_compose.py and the README's
# composition table); a pair added here is refused by init_mesh, ParallelConfig and the trainer alike.
REFUSED: Dict[Tuple[str, str], str] = {}


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_composition(pp: int = 1, tp: int = 1, ep: int = 1, fsdp: bool = False, sp: bool = False) -> None:
    """Raise ValueError naming the features if this combination does not compose (:data:`REFUSED`),
    or if a size is not a positive integer. Needs no world size (a config is checked before launch)."""
    pp, tp, ep = _size("pp", pp), _size("tp", tp), _size("ep", ep)
    if sp and tp == 1:
        raise ValueError("sequence parallelism (sp) needs tp > 1")
    on = {"pp": pp > 1, "tp": tp > 1, "ep": ep > 1, "fsdp": bool(fsdp), "sp": bool(sp)}
    shown = {"pp": f"pp={pp}", "tp": f"tp={tp}", "ep": f"ep={ep}", "fsdp": "fsdp", "sp": "sequence parallelism (sp)"}
    for (a, b), why in REFUSED.items():
        if on[a] and on[b]:
            raise ValueError(f"{shown[a]} with {shown[b]} is not supported: {why}")


@dataclass(frozen=True)
class ParallelDims:
    """The job's parallel sizes over ``world`` ranks (module docstring); checked on construction.

    Raises ValueError naming the values: a size that is not a positive integer, a world that
    ``pp x tp`` does not divide, an ``ep`` that does not divide the HDP units, or a combination in
    :data:`REFUSED`.
    """

    world: int
    pp: int = 1
    tp: int = 1
    ep: int = 1
    fsdp: bool = False
    sp: bool = False

    def __post_init__(self) -> None:
        world = _size("world", self.world)
        check_composition(self.pp, self.tp, self.ep, self.fsdp, self.sp)
        if world % (self.pp * self.tp):
            raise ValueError(f"the world of {world} ranks is not divisible by pp={self.pp} x tp={self.tp} = "
                             f"{self.pp * self.tp}; run on a multiple of {self.pp * self.tp} ranks or change tp/pp")
        if self.hdp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the {self.hdp} HDP units (world {world} / "
                             f"(pp={self.pp} x tp={self.tp})); expert-parallel groups are blocks of ep units")

    @property
    def hdp(self) -> int:
        """HDP units per pipeline stage: ``world / (pp x tp)``."""
        return self.world // (self.pp * self.tp)

    @property
    def grid(self) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
        """Every global rank at ``grid[p][h][t]``."""
        hdp, tp = self.hdp, self.tp
        return tuple(tuple(tuple((p * hdp + h) * tp + t for t in range(tp)) for h in range(hdp))
                     for p in range(self.pp))

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """``(stage, unit, tp_index)`` of a global rank."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} is outside the world of {self.world} ranks")
        unit, t = divmod(rank, self.tp)
        p, h = divmod(unit, self.hdp)
        return p, h, t

    def units(self, stage: int = 0):
        """The :class:`bytescale.planner.UnitMap` of one stage's HDP units (what the planner plans)."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage!r} is outside the {self.pp} pipeline stages")
        from .planner.units import UnitMap

        return UnitMap.grid(self.hdp, self.tp, first_rank=stage * self.hdp * self.tp)

    def describe(self) -> str:
        """``"pp 2 x hdp 3 x tp 2, ep 1"`` and the flags that are on."""
        flags = [f for f, on in (("fsdp", self.fsdp), ("sp", self.sp)) if on]
        return (f"pp {self.pp} x hdp {self.hdp} x tp {self.tp}, ep {self.ep}"
                + (f" ({', '.join(flags)})" if flags else ""))
