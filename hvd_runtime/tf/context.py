"""Horovod start-up for TensorFlow: init, one GPU per rank (or a fair share of the CPU), seeds.

Everything here must run before TensorFlow creates its first tensor: device visibility and
thread pools are fixed at that moment, and changing them later raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hvd_runtime.rank_context import RankContext
from hvd_runtime.scaling import cpu_threads, set_cycle_time


@dataclass(frozen=True)
class Context(RankContext):
    """Where this process's tensors live, and who it is in the job (rank and size read live)."""

    horovod_module: ClassVar[str] = "horovod.tensorflow"
    device: str     # "GPU:0" (the one GPU this rank sees) or "CPU:0"


def seed_everything(seed: int) -> None:
    """Python, NumPy and TF (hence Keras initialisers and dropout) from one number."""
    import keras

    keras.utils.set_random_seed(seed % 2**32)


def pin_devices(local_rank: int, local_size: int, threads_per_rank: int = 0, devices_per_rank: int = 1) -> str:
    """Show this rank only its own GPU(s), growing memory on demand; on CPU, cap its thread pools.

    Without memory growth the first rank's TF grabs nearly all of every GPU it sees; without the
    thread cap, N ranks on one host each start one thread per core and fight over them.
    devices_per_rank > 1 (model-split): this rank takes that many GPUs when the host has enough
    for every rank, else it splits its CPU into that many logical devices.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus and devices_per_rank > 1 and len(gpus) >= devices_per_rank * local_size:
        mine = gpus[local_rank * devices_per_rank:(local_rank + 1) * devices_per_rank]
        tf.config.set_visible_devices(mine, "GPU")
        for gpu in mine:
            tf.config.experimental.set_memory_growth(gpu, True)
        return "GPU:0"
    if gpus and devices_per_rank == 1:
        gpu = gpus[local_rank % len(gpus)]
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
        return "GPU:0"
    if gpus:
        tf.config.set_visible_devices([], "GPU")   # too few GPUs to split over: all stages on the CPU
    if devices_per_rank > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices_per_rank)
    threads = cpu_threads(local_size, threads_per_rank)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return "CPU:0"


def init_horovod(seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0,
                 devices_per_rank: int = 1, process_sets=None) -> Context:
    """hvd.init(), pin this rank's device(s), seed with seed + rank.

    Seeds differ per rank so dropout differs; the model itself is made identical by broadcasting
    rank 0's variables, and the data order comes from a seed shared by all ranks.
    """
    import horovod.tensorflow as hvd

    set_cycle_time(cycle_time_ms)
    hvd.init(process_sets=process_sets)  # process sets are fixed here (a pipeline's grid)
    device = pin_devices(hvd.local_rank(), hvd.local_size(), threads_per_rank, devices_per_rank)
    seed_everything(seed + hvd.rank())
    return Context(device)
