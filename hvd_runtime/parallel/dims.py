"""The rank grid every strategy shares: world = dp x pp x tp, and the Horovod process sets it needs.

    dims = ParallelDims(world=8, tp=2, pp=2)     # 2 data-parallel replicas of a 2-stage, 2-way split model
    dims.coords(5)                               # Coords(dp=1, pp=0, tp=1)
    dims.tp_ranks(5), dims.dp_ranks(5)           # [4, 5], [1, 5]
    dims.process_set_ranks(pairs=True)           # every set hvd.init must be given

Ranks are laid out tp innermost, then pp, then dp: rank = (dp * pp_size + pp) * tp_size + tp.
horovodrun fills a host before the next, so a tensor-parallel group (activations exchanged in
every layer, forward and backward) sits on one host; a replica's pipeline stages follow (one
activation per micro-batch); data-parallel replicas (one gradient allreduce per step) cross hosts.

Horovod needs every process set at `hvd.init` (unless HOROVOD_DYNAMIC_PROCESS_SETS=1), so the
grid lists them all beforehand: one per tensor-parallel group, one per data-parallel group (the
ranks holding the same parameters, which average gradients together), and with `pairs` one per
neighbouring pair of stages (when Horovod collectives carry the pipeline's messages). A group of
one needs no set, and the whole world reuses Horovod's global set.

Framework-free: no Horovod import; the strategies initialise Horovod with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hvd_runtime.config import ConfigError


class ParallelConfigError(ConfigError):
    """A layout that does not fit the world (-np against tp and stages) or the model being split."""


class Coords(NamedTuple):
    """Where a rank sits: its data-parallel replica, its pipeline stage, its place in the tp group."""

    dp: int
    pp: int
    tp: int


def _check_positive(value, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelConfigError(f"{name} must be a positive integer, got {value!r} (e.g. 2)")


@dataclass(frozen=True)
class ParallelDims:
    """world = dp x pp x tp, checked on construction with one line naming -np and the factors."""

    world: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        _check_positive(self.tp, "tp")
        _check_positive(self.pp, "stages")
        split = self.tp * self.pp
        if self.world % split == 0:
            return
        factors = [f"{name} {n}" for name, n in (("tp", self.tp), ("stages", self.pp)) if n > 1]
        option = " and ".join(f"a {name}" if len(factors) == 1 else name
                              for name, n in (("tp", self.tp), ("--stages", self.pp)) if n > 1)
        divides = "that divides" if len(factors) == 1 else "whose product divides"
        raise ParallelConfigError(f"world size {self.world} (horovodrun -np) is not {' x '.join(factors)} x replicas: "
                                  f"use -np {split}, {2 * split}, {3 * split}... or {option} {divides} {self.world}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def staggered(self) -> bool:
        """Some ranks reduce while others wait: a pipeline's tensor-parallel stages, one stage's
        groups summing while the next waits for its activations (hvd_runtime.scaling.set_cycle_time)."""
        return self.tp > 1 and self.pp > 1

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        return Coords(rank // (self.tp * self.pp), rank // self.tp % self.pp, rank % self.tp)

    def tp_ranks(self, rank: int) -> list[int]:
        """This rank's tensor-parallel group: same replica and stage, every slice of the split layers."""
        c = self.coords(rank)
        return [self.rank_of(c.dp, c.pp, t) for t in range(self.tp)]

    def pp_ranks(self, rank: int) -> list[int]:
        """The stages this rank's activations flow through, first to last (same replica and slice)."""
        c = self.coords(rank)
        return [self.rank_of(c.dp, p, c.tp) for p in range(self.pp)]

    def dp_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same parameters as this one: where its gradients are averaged."""
        c = self.coords(rank)
        return [self.rank_of(d, c.pp, c.tp) for d in range(self.dp)]

    def process_set_ranks(self, pairs: bool = False, ring: bool = False) -> list[list[int]]:
        """Every rank list that needs a process set of its own, each once, in a fixed order:
        tp groups, then dp groups, then (with `pairs`) neighbouring stages, with `ring` the last
        and first stage too (interleaved schedules)."""
        firsts = range(0, self.world, self.tp)
        groups = [self.tp_ranks(r) for r in firsts]
        groups += [self.dp_ranks(self.rank_of(0, p, t)) for p in range(self.pp) for t in range(self.tp)]
        if pairs:
            lanes = [self.pp_ranks(self.rank_of(d, 0, t)) for d in range(self.dp) for t in range(self.tp)]
            groups += [lane[s:s + 2] for lane in lanes for s in range(self.pp - 1)]
            if ring and self.pp > 2:
                groups += [[lane[0], lane[-1]] for lane in lanes]
        return [g for g in groups if 1 < len(g) < self.world]

    def describe(self) -> str:
        parts = ([f"{self.pp} stages"] if self.pp > 1 else []) + ([f"tp {self.tp}"] if self.tp > 1 else [])
        return f"{self.world} ranks = {' x '.join(parts + [f'{self.dp} replicas'])}"
