"""Which of a host's GPUs one model-split rank puts its stages on: a decision on counts alone.

Every model-split rank runs all `parallel.stages` stages of its own copy of the model, one GPU
per stage, and every rank on a host draws from the same GPUs. So a host with `local_size` ranks
needs stages x local_size GPUs; local rank k takes GPUs k*stages .. k*stages + stages - 1 (by
index among the GPUs the process sees, i.e. after CUDA_VISIBLE_DEVICES). With no GPU at all
every stage runs on the CPU. With some GPUs but too few, quietly falling back to the CPU would
leave the GPUs idle and the user unaware, so it is a config error naming the numbers and the
ways out. Framework-free, so that one rule serves PyTorch and TensorFlow and is tested without
a GPU; each framework's model_split module asks it with its own GPU count.
"""

from __future__ import annotations

from hvd_runtime.config import ConfigError


class TooFewGpus(ConfigError):
    """The host has GPUs, but not one per stage for every rank on it."""


def too_few_gpus_message(stages: int, local_size: int, visible_gpus: int) -> str:
    """One line: what was asked, what the host has, and each change that would fit."""
    needed = stages * local_size
    fixes = []
    if visible_gpus >= stages:
        fixes.append(f"run at most {visible_gpus // stages} rank(s) per host (horovodrun -H host:N, -np N x hosts)")
    if visible_gpus >= local_size:
        fixes.append(f"use fewer stages (--parallel.stages {visible_gpus // local_size})")
    fixes.append(f"use hosts with {needed} GPUs")
    return (f"model-split puts each stage on its own GPU: {local_size} rank(s) on this host (-np / ranks per host) "
            f"x {stages} stages (parallel.stages) need {needed} GPUs, but this host shows {visible_gpus}; "
            + ", or ".join(fixes))


def stage_gpus(stages: int, local_rank: int, local_size: int, visible_gpus: int) -> list[int] | None:
    """GPU indices of this rank's stages, in stage order; None when there is no GPU (all on the CPU).

    `visible_gpus`: GPUs the process sees; `local_rank` / `local_size`: Horovod's numbering of
    the ranks on this host. Raises TooFewGpus when 0 < visible_gpus < stages x local_size.
    """
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in 0..{local_size - 1}")
    if visible_gpus <= 0:
        return None
    if visible_gpus < stages * local_size:
        raise TooFewGpus(too_few_gpus_message(stages, local_size, visible_gpus))
    first = local_rank * stages
    return list(range(first, first + stages))


def local_rank_and_size(horovod_module: str) -> tuple[int, int]:
    """(local rank, local size) under Horovod (`horovod.torch` or `horovod.tensorflow`), else (0, 1):
    workers on a host share its GPUs."""
    import importlib

    try:
        hvd = importlib.import_module(horovod_module)
    except ImportError:
        return 0, 1
    return (hvd.local_rank(), hvd.local_size()) if hvd.is_initialized() else (0, 1)
