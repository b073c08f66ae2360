"""Horovod start-up for PyTorch: init, one device per rank, fair CPU threads, per-rank seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from hvd_runtime.rank_context import RankContext
from hvd_runtime.scaling import cpu_threads, set_cycle_time


@dataclass(frozen=True)
class Context(RankContext):
    """Where this process's tensors live, and who it is in the job (rank and size read live)."""

    horovod_module: ClassVar[str] = "horovod.torch"
    device: torch.device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pin_device(seed: int = 0, threads_per_rank: int = 0) -> torch.device:
    """After hvd.init(): this rank's GPU (by local rank), or the CPU with its share of the cores.

    Seeds differ per rank (seed + rank) so dropout and augmentation differ; the model itself is
    made identical by broadcasting rank 0's weights, and data order comes from a shared seed.
    """
    import horovod.torch as hvd

    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(hvd.local_size(), threads_per_rank))
    seed_everything(seed + hvd.rank())
    return device


def init_horovod(seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0) -> Context:
    """hvd.init(), then pin_device: the start of every data-parallel job."""
    import horovod.torch as hvd

    set_cycle_time(cycle_time_ms)
    hvd.init()
    return Context(pin_device(seed, threads_per_rank))
