"""The memory a rank will hold, planned before its model is made real, and a refusal where the
ranks of one host would need more than it has.

A rank holds its share of the model (all of it under data parallelism and model-split, its slices
under tensor parallelism, its stage in a pipeline) three times over in float32: the parameters,
their gradients, and the optimizer's state per parameter (Adam and AdamW: two moments; SGD with
momentum: one; plain SGD: none), ZeRO holding 1/replicas of the optimizer state (horovod.zero 1),
of the gradients too (2), of the parameters too (3) (Keras: a copy of the rank's rows besides, and
each backward pass's gradients whole); under ZeRO 3, the largest block whole three times over (in its
backward: its gradients, and the reduce-scatter's send and receive buffers of them), which the
paper's 16/N bytes a parameter leave out; plus the activations a step keeps for its backward pass. The
framework's parallelize counts the share on the model before any value is drawn (torch: the meta
device; Keras: the variables' shapes) and, where it can, the activations of one step (torch: a
forward on meta tensors, counting what autograd saves). Rank 0 prints the plan in one line; when
the ranks on a host, their plans summed, would need more than its memory (or its container's
limit), every rank of the job stops with one line before the first tensor is allocated, instead
of being killed half-way. It
plans a run's largest part, not every byte: the framework and its libraries, the data loader and
the messages between stages come on top.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from hvd_runtime.config import ConfigError
from hvd_runtime.scaling import ranks_on_this_machine

__all__ = ["MemoryPlan", "available_bytes", "optimizer_state_per_parameter", "settle", "verdict"]

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
    where neither can be read."""
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
    parameters: int        # elements of the model this rank's share is cut from (a tied tensor once)
    optimizer_state: int   # float32 values per parameter
    activations: int | None   # bytes a step keeps for backward; None: not estimated
    ranks_on_host: int
    recompute: bool
    zero: int = 0          # horovod.zero: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too
    replicas: int = 1      # the data-parallel ranks ZeRO shards over
    rows_copy: bool = False   # Keras under ZeRO: the rows a rank steps are a copy; a pass's gradients whole
    largest_block: int = 0    # ZeRO 3: elements of the largest block this rank gathers whole (its share under tp)

    def _held(self, stage: int) -> float:
        """The share a rank holds of a part that ZeRO shards from `stage` on."""
        return 1 / self.replicas if self.zero >= stage else 1.0

    @property
    def parameter_bytes(self) -> int:
        copy = 1 / self.replicas if self.rows_copy and self.zero else 0.0
        return round(self.parameters * FP32 * (self._held(3) + copy))

    @property
    def gradient_bytes(self) -> int:
        return round(self.parameters * FP32 * (1.0 if self.rows_copy else self._held(2)))

    @property
    def optimizer_bytes(self) -> int:
        return round(self.parameters * FP32 * self.optimizer_state * self._held(1))

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state, float32 (ZeRO: the rank's share of each)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def gathered_bytes(self) -> int:
        """ZeRO 3's working set on top of the rows: the largest block's gradients whole while its
        backward reduce-scatters them, with the send and receive buffers (float32, three times the block)."""
        return 3 * FP32 * self.largest_block if self.zero >= 3 else 0

    @property
    def rank_bytes(self) -> int:
        return self.state_bytes + self.gathered_bytes + (self.activations or 0)

    def line(self) -> str:
        acts = ("activations not estimated" if self.activations is None else
                f"activations {_gib(self.activations)}{' (blocks recomputed)' if self.recompute else ''}")
        sharded = f" under ZeRO {self.zero} over {self.replicas} replicas" if self.zero else ""
        gathered = f", a block gathered {_gib(self.gathered_bytes)}" if self.gathered_bytes else ""
        return (f"memory: each rank holds about {_gib(self.rank_bytes)} ({self.parameters:,} parameters{sharded}: "
                f"{_gib(self.parameter_bytes)}, gradients {_gib(self.gradient_bytes)}, optimizer state "
                f"{_gib(self.optimizer_bytes)}{gathered}, {acts}); {self.ranks_on_host} on this host")

    def check(self, available: int | None, splits: str) -> None:
        """Refuse (ConfigError) when this host's ranks, each holding as much as this one, would need
        more than `available` bytes. `splits`: the settings of this strategy that hold less per rank."""
        problem = verdict([("", available, self)] * self.ranks_on_host, splits)
        if problem is not None:
            raise ConfigError(problem)

    def refusal(self, needed: int, ranks: int, alike: bool, available: int, splits: str) -> str:
        """The line that refuses a host whose `ranks` would need `needed` bytes, this plan being the
        largest of them (`alike`: as large as every other)."""
        fixes = [] if self.recompute or self.activations is None else ["model.recompute blocks (activations)"]
        acts = "activations not counted" if self.activations is None else f"{_gib(self.activations)} of activations"
        gathered = f", {_gib(self.gathered_bytes)} of a block gathered" if self.gathered_bytes else ""
        return (f"memory: the {ranks} rank(s) on this host would hold about {_gib(needed)} "
                f"({_gib(self.rank_bytes)} {'each' if alike else 'on the fullest'}: {_gib(self.state_bytes)} of "
                f"parameters, gradients and optimizer state{gathered}, {acts}), more than the {_gib(available)} of "
                f"this host: "
                f"use fewer ranks on this host, a smaller model, or {', '.join(fixes + [splits])}")


def verdict(plans: list[tuple[str, int | None, MemoryPlan]], splits: str) -> str | None:
    """The refusal of the first host whose ranks' plans together need more than it has; None when
    every host holds its ranks. `plans`: each rank's (host name, available_bytes there, plan)."""
    hosts: dict[str, tuple[int | None, list[MemoryPlan]]] = {}
    for host, available, plan in plans:
        hosts.setdefault(host, (available, []))[1].append(plan)
    for available, held in hosts.values():
        needed = sum(plan.rank_bytes for plan in held)
        if available is not None and needed > available:
            fullest = max(held, key=lambda plan: plan.rank_bytes)
            alike = all(plan.rank_bytes == fullest.rank_bytes for plan in held)
            return fullest.refusal(needed, len(held), alike, available, splits)
    return None


def settle(parameters: int, activations: int | None, ctx, cfg, splits: str, rows_copy: bool = False,
           largest_block: int = 0) -> MemoryPlan:
    """This rank's plan: printed by rank 0; then every rank of the job stops (ConfigError) with
    one line where any host's ranks would need more than it has. The ranks judge together, from
    every rank's plan: a pipeline's stages differ, and a rank that stopped alone would have
    horovodrun end the others before they could say why. `rows_copy`, `largest_block`: MemoryPlan's."""
    plan = MemoryPlan(parameters, optimizer_state_per_parameter(cfg.optim), activations,
                      ranks_on_this_machine(ctx.local_size, ctx.size),
                      cfg.model.recompute == "blocks", cfg.horovod.zero, ctx.data_size, rows_copy, largest_block)
    if ctx.is_root:
        print(plan.line(), flush=True)
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        # a worker that joins later starts alone, outside any collective of the others; every rank
        # of an elastic job holds the whole model, so each judges its host alike by itself
        plan.check(available_bytes(), splits)
        return plan
    hvd = importlib.import_module(ctx.horovod_module)
    plans = hvd.allgather_object((socket.gethostname(), available_bytes(), plan), name="memory_plan.plans")
    problem = verdict(plans, splits)
    if problem is not None:
        raise ConfigError(problem)
    return plan


def _gib(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"
