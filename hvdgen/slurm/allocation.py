"""What a Slurm allocation gave, read from the variables Slurm sets in it, for `hvdgen doctor`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    job: str
    nodelist: str
    nodes: int
    tasks: int
    tasks_per_node: list[int]  # one entry per node
    gpus_per_node: int | None  # None: Slurm said nothing of GPUs

    @property
    def even(self) -> bool:
        return len(set(self.tasks_per_node)) == 1

    def describe(self) -> str:
        spread = (f"{self.tasks_per_node[0]} a node" if self.even
                  else "unevenly: " + ",".join(map(str, self.tasks_per_node)))
        gpus = "no GPUs" if not self.gpus_per_node else f"{self.gpus_per_node} GPUs a node"
        return f"job {self.job}: {self.nodes} node(s) ({self.nodelist}), {self.tasks} task(s), {spread}, {gpus}"


def _expand(counts: str) -> list[int]:
    """Slurm's compressed counts, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in filter(None, counts.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match:
            out += [int(match.group(1))] * int(match.group(2) or 1)
    return out


def _gpus(environ: Mapping[str, str]) -> int | None:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(key, "").rsplit(":", 1)[-1]
        if value.isdigit():
            return int(value)
    return None


def allocation(environ: Mapping[str, str]) -> Allocation | None:
    """The allocation this process runs in, or None outside one."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    per_node = _expand(environ.get("SLURM_TASKS_PER_NODE", ""))
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or len(per_node) or 1)
    tasks = int(environ.get("SLURM_NTASKS") or sum(per_node) or nodes)
    return Allocation(job, environ.get("SLURM_JOB_NODELIST", "?"), nodes, tasks, per_node or [tasks // nodes] * nodes,
                      _gpus(environ))
