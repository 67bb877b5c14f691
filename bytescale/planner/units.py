"""HDP units: the "ranks" the planner plans when tensor parallelism groups processes.

ByteScale replaces only data and context parallelism by its HDP pool; tensor (and pipeline)
parallelism stay, sized by the model. The planner therefore plans HDP *units*: a unit is the TP
group of ranks that computes one share of the step together. A :class:`UnitMap` is the map from
unit to the unit's global ranks (in TP order). Every TP rank of a unit runs the unit's
micro-batches in the same order; a ring over units ``(u0, u1, ...)`` runs once per TP index ``t``,
among the ranks ``(units[u0][t], units[u1][t], ...)``, on the heads that TP index holds.

With TP = 1 every unit is one rank and the map is the identity (``UnitMap.identity(world)``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["UnitMap"]


@dataclass(frozen=True)
class UnitMap:
    """``units[u]``: the global ranks of HDP unit ``u``, in TP-index order (see module docstring).

    Every unit has the same number of ranks (the TP degree); no rank is in two units.
    """

    units: Tuple[Tuple[int, ...], ...]
    _where: Dict[int, Tuple[int, int]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        units = tuple(tuple(int(r) for r in u) for u in self.units)
        object.__setattr__(self, "units", units)
        if not units or not units[0]:
            raise ValueError(f"UnitMap: needs at least one unit of at least one rank, got {list(units)}")
        tp = len(units[0])
        where: Dict[int, Tuple[int, int]] = {}
        for u, ranks in enumerate(units):
            if len(ranks) != tp:
                raise ValueError(f"UnitMap: unit {u} has {len(ranks)} ranks {list(ranks)}, unit 0 has {tp}: "
                                 "every unit must have the same TP degree")
            for t, r in enumerate(ranks):
                if r < 0:
                    raise ValueError(f"UnitMap: unit {u} has a negative rank {r}")
                if r in where:
                    raise ValueError(f"UnitMap: rank {r} is in unit {where[r][0]} and in unit {u}")
                where[r] = (u, t)
        object.__setattr__(self, "_where", where)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def identity(cls, world_size: int) -> "UnitMap":
        """One rank per unit (no tensor parallelism): unit ``u`` is rank ``u``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"UnitMap.identity: world_size must be an integer >= 1, got {world_size!r}")
        if cls is UnitMap:  # immutable: one shared map per size (building 16,384 units took ~10 ms a plan)
            return _identity(world_size)
        return cls(tuple((r,) for r in range(world_size)))

    @classmethod
    def grid(cls, hdp: int, tp: int, first_rank: int = 0) -> "UnitMap":
        """``hdp`` units of ``tp`` consecutive ranks from ``first_rank`` (TP innermost, the layout
        of :func:`bytescale.init_mesh`; a pipeline stage ``p`` starts at ``p * hdp * tp``)."""
        for name, v in (("hdp", hdp), ("tp", tp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"UnitMap.grid: {name} must be an integer >= 1, got {v!r}")
        if cls is UnitMap and isinstance(first_rank, int) and not isinstance(first_rank, bool):
            return _grid(hdp, tp, first_rank)
        return cls(tuple(tuple(first_rank + u * tp + t for t in range(tp)) for u in range(hdp)))

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def tp(self) -> int:
        """Ranks per unit (the TP degree)."""
        return len(self.units[0])

    @property
    def ranks(self) -> Tuple[int, ...]:
        """Every rank of every unit, unit by unit."""
        return tuple(r for u in self.units for r in u)

    @property
    def is_identity(self) -> bool:
        return self.tp == 1 and all(u[0] == i for i, u in enumerate(self.units))

    def __len__(self) -> int:
        return len(self.units)

    def __contains__(self, rank: int) -> bool:
        return int(rank) in self._where

    def locate(self, rank: int) -> Tuple[int, int]:
        """(unit, TP index) of global ``rank``; ValueError naming the rank and the map if absent."""
        try:
            return self._where[int(rank)]
        except KeyError:
            raise ValueError(f"UnitMap: rank {rank} is in no HDP unit of {self.describe()}") from None

    def unit_of(self, rank: int) -> int:
        return self.locate(rank)[0]

    def tp_index(self, rank: int) -> int:
        return self.locate(rank)[1]

    def rank(self, unit: int, tp_index: int = 0) -> int:
        """The global rank at ``tp_index`` of ``unit``."""
        if not 0 <= unit < len(self.units):
            raise IndexError(f"UnitMap: unit {unit} outside [0, {len(self.units)})")
        if not 0 <= tp_index < self.tp:
            raise IndexError(f"UnitMap: TP index {tp_index} outside [0, {self.tp})")
        return self.units[unit][tp_index]

    def ring(self, unit_ring: Sequence[int], tp_index: int) -> Tuple[int, ...]:
        """The global ranks of the ring over units ``unit_ring`` that TP index ``tp_index`` runs."""
        return tuple(self.rank(int(u), tp_index) for u in unit_ring)

    def hdp_group(self, tp_index: int) -> Tuple[int, ...]:
        """The ranks of ``tp_index`` in every unit (the HDP dimension of that TP index)."""
        return tuple(u[tp_index] for u in self.units)

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_list(self) -> List[List[int]]:
        return [list(u) for u in self.units]

    @classmethod
    def from_list(cls, units: Any) -> "UnitMap":
        if not isinstance(units, (list, tuple)) or not all(isinstance(u, (list, tuple)) for u in units):
            raise ValueError(f"UnitMap.from_list: expected a list of rank lists, got {units!r}")
        return cls(tuple(tuple(u) for u in units))

    def describe(self) -> str:
        """``"4 units x TP 2: [[0, 1], [2, 3], [4, 5], [6, 7]]"`` (long maps abbreviated)."""
        body = self.to_list()
        text = str(body) if len(body) <= 8 else f"{body[:3]} ... {body[-1:]}"
        return f"{self.num_units} units x TP {self.tp}: {text}"


@functools.lru_cache(maxsize=32)
def _identity(world_size: int) -> UnitMap:
    return UnitMap(tuple((r,) for r in range(world_size)))


@functools.lru_cache(maxsize=32)
def _grid(hdp: int, tp: int, first_rank: int) -> UnitMap:
    return UnitMap(tuple(tuple(first_rank + u * tp + t for t in range(tp)) for u in range(hdp)))
