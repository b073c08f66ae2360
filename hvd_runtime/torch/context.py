"""Horovod start-up for PyTorch: init, this rank's GPU (or fair CPU threads), per-rank seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from hvd_runtime.devices import stage_gpus
from hvd_runtime.host_memory import keep_freed_memory
from hvd_runtime.parallel.tensor_groups import TensorRanks, init_tensor_parallel
from hvd_runtime.pipeline.grid import PipelineRank
from hvd_runtime.rank_context import RankContext
from hvd_runtime.scaling import cpu_threads, ranks_on_this_machine, set_cycle_time


@dataclass(frozen=True)
class Context(RankContext):
    """Where this process's tensors live, and who it is in the job (rank and size read live)."""

    horovod_module: ClassVar[str] = "horovod.torch"
    device: torch.device
    tensor: TensorRanks | None = None
    pipeline: PipelineRank | None = None
    stage_devices: int | None = None   # model-split: the devices this rank splits the model over


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_gpu(local_rank: int, local_size: int, visible_gpus: int, devices_per_rank: int = 1) -> int | None:
    """The GPU this rank pins and puts its batches on, by index among the visible ones; None: the CPU.

    One device per rank (data, pipeline): the GPU of its local rank. model-split
    (devices_per_rank = stages): the first of its stage GPUs as hvd_runtime.devices.stage_gpus
    places them, where stage 0 and the batches live, so no batch lands on another rank's GPU;
    too few GPUs is stage_gpus' one-line TooFewGpus, raised before CUDA is touched.
    """
    if devices_per_rank > 1:
        gpus = stage_gpus(devices_per_rank, local_rank, local_size, visible_gpus)
        return None if gpus is None else gpus[0]
    return local_rank if visible_gpus > 0 else None


def pin_device(seed: int = 0, threads_per_rank: int = 0, devices_per_rank: int = 1) -> torch.device:
    """After hvd.init(): this rank's GPU (rank_gpu), or the CPU with its share of the cores.

    Seeds differ per rank (seed + rank) so dropout and augmentation differ; the model itself is
    made identical by broadcasting rank 0's weights, and data order comes from a shared seed.
    """
    import horovod.torch as hvd

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = rank_gpu(hvd.local_rank(), hvd.local_size(), visible, devices_per_rank)
    if gpu is not None:
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(ranks_on_this_machine(hvd.local_size(), hvd.size()), threads_per_rank))
        keep_freed_memory()   # a step's tensors reuse the last step's pages: no page faults (host_memory)
    seed_everything(seed + hvd.rank())
    return device


def init_horovod(seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0,
                 devices_per_rank: int | None = None, tp: int | None = None) -> Context:
    """hvd.init(), then pin_device: the start of every data-parallel job.

    devices_per_rank: the model-split's stages (one GPU each); ctx.device is then stage 0's GPU,
    and ctx.stage_devices says parallelize to split the model over them.
    tp: tensor parallelism's group size; Horovod starts with the process sets of tp groups and
    data-parallel groups (ctx.tensor), and ctx.data_rank / data_size count replicas, not ranks.
    """
    import horovod.torch as hvd

    set_cycle_time(cycle_time_ms, gpu=torch.cuda.is_available())
    tensor = None
    if tp is None:
        hvd.init()
    else:
        tensor = init_tensor_parallel(hvd, tp)
    return Context(pin_device(seed, threads_per_rank, devices_per_rank or 1), tensor, stage_devices=devices_per_rank)
