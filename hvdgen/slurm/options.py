"""The Slurm answers of a project: what `hvdgen slurm` asks, checked before the batch script is written.

Kept in `.hvdgen.yaml` under `slurm:` (hvdgen/answers.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hvdgen.answers import Answers
from hvdgen.errors import HvdgenError
from hvdgen.k8s.limits import MAX_GPUS_PER_POD, MAX_WORKERS

CONTROLLERS = ("gloo", "mpi")  # gloo: one horovodrun on the batch node, over ssh; mpi: srun starts the ranks
MPI_PLUGINS = ("pmix", "pmi2")  # srun --mpi=...: how an MPI rank learns its rank from Slurm
MAX_TASKS_PER_NODE = 256  # CPU ranks per node: above the largest machines' cores
MAX_SIGNAL_S = 65535  # sbatch --signal's largest lead time
# Slurm's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds.
_TIME = re.compile(r"(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a partition or account name
_RANGES = (("nodes", 1, MAX_WORKERS, 2), ("gpus_per_node", 0, MAX_GPUS_PER_POD, 4),
           ("tasks_per_node", 0, MAX_TASKS_PER_NODE, 2), ("grace_s", 10, MAX_SIGNAL_S, 120))


def time_limit_s(text: str) -> int | None:
    """Seconds in a Slurm time limit, or None when `text` is not one."""
    match = _TIME.fullmatch(text)
    if not match:
        return None
    parts = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "days" in parts:
        return ((parts["days"] * 24 + parts["dh"]) * 60 + parts.get("dm", 0)) * 60 + parts.get("ds", 0)
    if "c" in parts:
        return (parts["a"] * 60 + parts["b"]) * 60 + parts["c"]
    return parts["a"] * 60 + parts.get("b", 0)


@dataclass(frozen=True)
class SlurmOptions(Answers):
    """One batch job's shape. Defaults: 2 nodes of 4 GPUs, horovodrun over Gloo, no partition,
    account or time limit (the cluster's defaults)."""

    RANGES = _RANGES
    SECTION = "slurm"
    EXAMPLES = {"partition": "gpu", "account": "ml-team", "time": "1-00:00:00"}

    nodes: int = 2
    gpus_per_node: int = 4  # 0: CPU nodes, whose ranks per node are tasks_per_node
    tasks_per_node: int = 0  # CPU nodes only: ranks a node runs; 0 means the layout's least
    partition: str = ""
    time: str = ""  # the job's time limit, in Slurm's format (e.g. 1-00:00:00); empty: the partition's
    account: str = ""
    controller: str = "gloo"  # gloo: horovodrun over ssh from the batch node; mpi: srun --mpi=<mpi_plugin>
    mpi_plugin: str = "pmix"
    grace_s: int = 120  # USR1 this long before the time limit: the ranks checkpoint, the job requeues

    def __post_init__(self) -> None:
        self.check_fields()
        if self.tasks_per_node and self.gpus_per_node:
            raise HvdgenError(f"--tasks-per-node is for CPU nodes: with --gpus-per-node {self.gpus_per_node} a "
                              "node runs one rank per GPU; leave it out, or give --gpus-per-node 0")
        if self.controller not in CONTROLLERS:
            raise HvdgenError(f"--controller {self.controller!r} is not known: choose gloo or mpi")
        if self.mpi_plugin not in MPI_PLUGINS:
            raise HvdgenError(f"--mpi-plugin {self.mpi_plugin!r} is not known: choose pmix or pmi2")
        for name in ("partition", "account"):
            value = getattr(self, name)
            if value and not _NAME.fullmatch(value):
                raise HvdgenError(f"--{name} {value!r} is not a Slurm {name} name: use letters, digits, '_', '.' "
                                  f"and '-' (e.g. --{name} gpu)")
        if self.time:
            limit = time_limit_s(self.time)
            if limit is None:
                raise HvdgenError(f"--time {self.time!r} is not a Slurm time limit: use minutes, HH:MM:SS or "
                                  "D-HH:MM:SS (e.g. --time 1-00:00:00)")
            if limit <= self.grace_s:
                raise HvdgenError(f"--time {self.time} leaves no training before the stop signal {self.grace_s} s "
                                  f"ahead of it: give a longer --time, or a --grace-s below {limit}")

    def updated(self, **changes) -> "SlurmOptions":
        """These answers with the given options changed; None means "keep the recorded answer".
        GPUs given leave CPU tasks per node behind (they apply to CPU nodes only)."""
        if changes.get("gpus_per_node"):
            changes = {"tasks_per_node": 0} | {k: v for k, v in changes.items() if v is not None}
        return self.with_changes(changes)
