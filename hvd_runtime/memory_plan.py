"""The memory a rank will hold, planned before its model is made real, and a refusal where the
ranks of one host would need more than it has.

A rank holds its share of the model (all of it under data parallelism and model-split, its slices
under tensor parallelism, its stage in a pipeline) three times over in float32: the parameters,
their gradients, and the optimizer's state per parameter (Adam and AdamW: two moments; SGD with
momentum: one; plain SGD: none), plus the activations a step keeps for its backward pass. The
framework's parallelize counts the share on the model before any value is drawn (torch: the meta
device; Keras: the variables' shapes) and, where it can, the activations of one step (torch: a
forward on meta tensors, counting what autograd saves). Rank 0 prints the plan in one line; when
the ranks on this host would need more than its memory (or its container's limit), every rank
stops with one line before the first tensor is allocated, instead of being killed half-way. It
plans a run's largest part, not every byte: the framework and its libraries, the data loader and
the messages between stages come on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hvd_runtime.config import ConfigError

__all__ = ["MemoryPlan", "available_bytes", "optimizer_state_per_parameter", "settle"]

GIB = 2**30
FP32 = 4


def optimizer_state_per_parameter(optim_cfg) -> int:
    """float32 values of optimizer state a parameter carries."""
    if optim_cfg.name in ("adam", "adamw"):
        return 2
    return 1 if optim_cfg.momentum else 0


def available_bytes(meminfo: Path = Path("/proc/meminfo"),
                    limits: tuple[Path, ...] = (Path("/sys/fs/cgroup/memory.max"),
                                                Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))) -> int | None:
    """The host's memory (MemTotal), or the container's limit where one is set below it; None
    where neither can be read. The same on every rank of a host, so they all give one verdict."""
    total = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit in limits:
        try:
            value = int(limit.read_text().strip())   # "max": no limit
        except (OSError, ValueError):
            continue
        total = value if total is None else min(total, value)
    return total


@dataclass(frozen=True)
class MemoryPlan:
    parameters: int        # elements this rank holds of the model (a tied tensor once)
    optimizer_state: int   # float32 values per parameter
    activations: int | None   # bytes a step keeps for backward; None: not estimated
    ranks_on_host: int
    recompute: bool

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state, float32."""
        return self.parameters * FP32 * (2 + self.optimizer_state)

    @property
    def rank_bytes(self) -> int:
        return self.state_bytes + (self.activations or 0)

    def line(self) -> str:
        acts = ("activations not estimated" if self.activations is None else
                f"activations {_gib(self.activations)}{' (blocks recomputed)' if self.recompute else ''}")
        return (f"memory: each rank holds about {_gib(self.rank_bytes)} ({self.parameters:,} parameters: "
                f"{_gib(self.parameters * FP32)} and as much in gradients, optimizer state "
                f"{_gib(self.parameters * FP32 * self.optimizer_state)}, {acts}); {self.ranks_on_host} on this host")

    def check(self, available: int | None, splits: str) -> None:
        """Refuse (ConfigError) when this host's ranks would need more than `available` bytes.
        `splits`: the settings of this strategy that hold less per rank."""
        needed = self.rank_bytes * self.ranks_on_host
        if available is None or needed <= available:
            return
        fixes = [] if self.recompute or self.activations is None else ["model.recompute blocks (activations)"]
        acts = "activations not counted" if self.activations is None else f"{_gib(self.activations)} of activations"
        raise ConfigError(f"memory: the {self.ranks_on_host} rank(s) on this host would hold about {_gib(needed)} "
                          f"({_gib(self.rank_bytes)} each: {_gib(self.state_bytes)} of parameters, gradients and "
                          f"optimizer state, {acts}), more than the {_gib(available)} of this host: use fewer ranks on "
                          f"this host, a smaller model, or {', '.join(fixes + [splits])}")


def settle(parameters: int, activations: int | None, ctx, cfg, splits: str) -> MemoryPlan:
    """This rank's plan: printed by rank 0, then refused (ConfigError) on every rank where this
    host's ranks would need more than it has."""
    plan = MemoryPlan(parameters, optimizer_state_per_parameter(cfg.optim), activations, ctx.local_size,
                      cfg.model.recompute == "blocks")
    if ctx.is_root:
        print(plan.line(), flush=True)
    plan.check(available_bytes(), splits)
    return plan


def _gib(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"
