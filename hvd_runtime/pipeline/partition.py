"""Split a sequence of blocks into contiguous, balanced stages.

A pipeline is only as fast as its slowest stage, so the split minimises the largest stage cost.
Costs are whatever the caller measured per block: parameter counts (memory balance, free to
compute) or seconds of forward + backward (speed balance; see `hvd_runtime.torch.stage`).

    plan = partition(names, costs, stages=2)                 # balanced
    plan = partition(names, costs, stages=2, starts=["fc3"])  # stage 1 starts at block "fc3"
    plan = partition(names, costs, stages=2, starts=[3])      # ... or at block index 3
    plan.bounds -> [(0, 3), (3, 6)]

Framework-free: blocks are given as names and costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from hvd_runtime.config import ConfigError


class PartitionError(ConfigError):
    """The blocks cannot be split as asked (a config error: `parallel.stages` or `parallel.partition`)."""


@dataclass(frozen=True)
class Partition:
    """Stage k runs blocks names[bounds[k][0]:bounds[k][1]].

    `unit` says what the costs count ("parameters", "s", or "" when the caller did not say), so
    that the run log's `parallel.partition` line reads unambiguously: a `time` run resumed at its
    checkpoint's cut, or cut where the user said, shows parameter counts, not seconds.
    """

    names: tuple[str, ...]
    costs: tuple[float, ...]
    bounds: tuple[tuple[int, int], ...]
    unit: str = ""

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def cut(self) -> dict:
        """Where it cuts, as a checkpoint keeps it (JSON): the block names and each stage's bounds."""
        return {"names": list(self.names), "bounds": [list(b) for b in self.bounds]}

    def stage_names(self, stage: int) -> list[str]:
        start, stop = self.bounds[stage]
        return list(self.names[start:stop])

    def stage_costs(self) -> list[float]:
        return [sum(self.costs[a:b]) for a, b in self.bounds]

    def imbalance(self) -> float:
        """Slowest stage over the mean stage: 1.0 is perfect balance."""
        costs = self.stage_costs()
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    def describe(self) -> str:
        parts = []
        for k, cost in enumerate(self.stage_costs()):
            names = self.stage_names(k)
            span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
            parts.append(f"stage {k}: {span} ({len(names)} block{'' if len(names) == 1 else 's'}, {self._cost(cost)})")
        return "; ".join(parts)

    def _cost(self, cost: float) -> str:
        if self.unit == "s":
            ms = cost * 1e3
            return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"   # never 1.23e+03
        if self.unit == "parameters":
            return f"{cost:,.0f} parameters"
        return f"cost {cost:g}"


def _balanced_bounds(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous split minimising the largest stage sum (dynamic programming, O(n^2 p)).

    Among equally good splits the earliest cut wins, so the result is deterministic.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-stage-cost putting blocks [0, i) into k stages (each non-empty)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def _resolve_starts(starts: Sequence, names: Sequence[str], stages: int) -> list[int]:
    if len(starts) != stages - 1:
        raise PartitionError(f"stage starts need {stages - 1} block(s), where stages 1..{stages - 1} start, got "
                             f"{len(starts)}: {list(starts)!r} (e.g. starts={[names[len(names) // 2]]!r})")
    indices = []
    for item in starts:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise PartitionError(f"stage starts are block names or indices, got {item!r}")
        if isinstance(item, str):
            if item not in names:
                raise PartitionError(f"stage start {item!r} is not a block: blocks are {', '.join(names)}")
            item = list(names).index(item)
        if not 0 < item < len(names):
            raise PartitionError(f"stage start {item} is out of range: stage starts must be 1..{len(names) - 1}")
        indices.append(item)
    if indices != sorted(set(indices)):
        raise PartitionError(f"stage starts must be distinct blocks in model order, got {list(starts)!r}")
    return indices


def partition(names: Sequence[str], costs: Sequence[float], stages: int, starts: Sequence | None = None,
              unit: str = "") -> Partition:
    """Cut blocks into `stages` contiguous non-empty stages, balanced or where `starts` says (the
    blocks where stages 1.. begin);
    `unit` names what the costs count (Partition.unit)."""
    names = [str(n) for n in names]
    if len(names) != len(costs):
        raise PartitionError(f"got {len(names)} block names but {len(costs)} costs")
    if len(set(names)) != len(names):
        raise PartitionError(f"block names must be unique, got {names}")
    if not isinstance(stages, int) or stages < 1:
        raise PartitionError(f"stages must be a positive integer, got {stages!r} (e.g. 2)")
    if stages > len(names):
        raise PartitionError(f"cannot split {len(names)} blocks into {stages} stages: "
                             f"every stage needs a block; use stages <= {len(names)}")
    if any(c < 0 for c in costs):
        raise PartitionError(f"block costs must be >= 0, got {list(costs)}")
    if starts is not None:
        edges = [0, *_resolve_starts(starts, names, stages), len(names)]
        bounds = list(zip(edges[:-1], edges[1:]))
    else:
        bounds = _balanced_bounds([float(c) for c in costs], stages)
    return Partition(tuple(names), tuple(float(c) for c in costs), tuple(bounds), unit)


def plan_partition(names: Sequence[str], stages: int, by, param_costs: Callable[[], Sequence[float]],
                   time_costs: Callable[[], Sequence[float]] | None = None) -> Partition:
    """by="params", by="time", stage starts (block names or indices), or a ready Partition.

    Costs come from callables so that only the chosen one is measured (timing runs the model).
    """
    if isinstance(by, Partition):
        return by
    if isinstance(by, str) and by in ("params", "time"):
        if by == "time":
            if time_costs is None:
                raise PartitionError("partition by='time' needs sample=<a batch of inputs> to time each block")
            return partition(names, time_costs(), stages, unit="s")
        return partition(names, param_costs(), stages, unit="parameters")
    if isinstance(by, str):
        raise PartitionError(f"partition {by!r} is unknown: use 'params', 'time', or stage starts like ['4']")
    return partition(names, param_costs(), stages, starts=list(by), unit="parameters")


def plan_on_rank0(plan: Callable[[], Partition], rank: int, broadcast: Callable[[object], object]) -> Partition:
    """One plan for a whole job: rank 0 calls `plan`, every rank takes rank 0's Partition.

    For a timed plan: timings differ from rank to rank, and every rank must cut alike. The other
    ranks do not time at all: their timings would be thrown away, and beside rank 0 on shared
    cores they would skew its. A refusal (PartitionError) travels the same way, so every rank stops
    with rank 0's one line instead of waiting for a plan that never comes. `broadcast(obj)` is the
    framework's hvd.broadcast_object from rank 0.
    """
    planned = None
    if rank == 0:
        try:
            planned = plan()
        except PartitionError as refusal:
            planned = refusal
    planned = broadcast(planned)
    if isinstance(planned, PartitionError):
        raise planned
    return planned


def refuse_weights_shared_across_stages(plan: Partition, block_weights: Sequence[tuple[str, Iterable]]) -> None:
    """Stop with one line if a weight object is held by blocks of two different stages.

    `block_weights` is (block name, its weights) per block, in order: torch parameters or Keras
    variables alike, recognised by identity. A tied weight (a language model's head reusing its
    token embedding) is one tensor: split over stages it would live on two ranks or devices and
    get two different updates.
    """
    owner: dict[int, tuple[int, str]] = {}
    for k, (start, stop) in enumerate(plan.bounds):
        for name, weights in block_weights[start:stop]:
            for w in weights:
                first = owner.setdefault(id(w), (k, name))
                if first[0] != k:
                    raise PartitionError(f"blocks {first[1]} and {name} share a parameter (tied weights) but fall on "
                                         f"different stages: untie them (a GPT's model.tie_embeddings: false), or "
                                         f"keep both on one stage")
