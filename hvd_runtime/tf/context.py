"""Horovod start-up for TensorFlow: init, this rank's GPU(s) (or a fair share of the CPU), seeds.

Everything here must run before TensorFlow creates its first tensor: device visibility and
thread pools are fixed at that moment, and changing them later raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hvd_runtime.devices import stage_gpus
from hvd_runtime.parallel.tensor_groups import TensorRanks, init_tensor_parallel
from hvd_runtime.pipeline.grid import PipelineRank
from hvd_runtime.rank_context import RankContext
from hvd_runtime.scaling import cpu_threads, ranks_on_this_machine, set_cycle_time
from hvd_runtime.tf.native_logs import quiet_native_notices


@dataclass(frozen=True)
class Context(RankContext):
    """Where this process's tensors live, and who it is in the job (rank and size read live)."""

    horovod_module: ClassVar[str] = "horovod.tensorflow"
    device: str     # "GPU:0" (the first GPU this rank sees: its own, or stage 0's) or "CPU:0"
    tensor: TensorRanks | None = None
    pipeline: PipelineRank | None = None
    stage_devices: int | None = None   # model-split: the devices this rank splits the model over


def seed_everything(seed: int) -> None:
    """Python, NumPy and TF (hence Keras initialisers and dropout) from one number."""
    import keras

    keras.utils.set_random_seed(seed % 2**32)


def rank_gpus(local_rank: int, local_size: int, gpu_count: int, devices_per_rank: int = 1) -> list[int] | None:
    """Which of the host's GPUs (by index) this rank keeps visible; None: no GPU, the CPU.

    One device per rank (data, pipeline): the GPU of its local rank (wrapping around when ranks
    outnumber GPUs). model-split (devices_per_rank = stages): its stage GPUs, placed by
    hvd_runtime.devices.stage_gpus as ModelSplit will look for them; too few GPUs is its
    one-line TooFewGpus, raised here, before TensorFlow fixes its devices.
    """
    if devices_per_rank > 1:
        return stage_gpus(devices_per_rank, local_rank, local_size, gpu_count)
    return [local_rank % gpu_count] if gpu_count > 0 else None


def physical_gpus() -> list:
    """tf.config.list_physical_devices("GPU"). The first device query of a process is where a host
    without NVIDIA driver gets TensorFlow's cuInit "error" notice (hvd_runtime.tf.native_logs)."""
    import tensorflow as tf

    with quiet_native_notices():
        return tf.config.list_physical_devices("GPU")


def pin_devices(local_rank: int, local_size: int, threads_per_rank: int = 0, devices_per_rank: int = 1,
                on_machine: int | None = None) -> str:
    """Show this rank only its own GPU(s) (rank_gpus), growing memory on demand; on CPU, cap its thread pools.

    Without memory growth the first rank's TF grabs nearly all of every GPU it sees; without the
    thread cap, N ranks on one host each start one thread per core and fight over them.
    devices_per_rank > 1 (model-split) on a host without GPUs: the CPU is split into that many
    logical devices, one per stage. on_machine: the ranks sharing this machine's cores
    (hvd_runtime.scaling.ranks_on_this_machine), local_size where not given.
    """
    import tensorflow as tf

    gpus = physical_gpus()
    mine = rank_gpus(local_rank, local_size, len(gpus), devices_per_rank)
    if mine is not None:
        shown = [gpus[k] for k in mine]
        tf.config.set_visible_devices(shown, "GPU")
        for gpu in shown:
            tf.config.experimental.set_memory_growth(gpu, True)
        return "GPU:0"
    if devices_per_rank > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices_per_rank)
    threads = cpu_threads(on_machine or local_size, threads_per_rank)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return "CPU:0"


def init_horovod(seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0,
                 devices_per_rank: int | None = None, process_sets=None, tp: int | None = None,
                 staggered: bool = False) -> Context:
    """hvd.init(), pin this rank's device(s), seed with seed + rank.

    Seeds differ per rank so dropout differs; the model itself is made identical by broadcasting
    rank 0's variables, and the data order comes from a seed shared by all ranks.
    tp: tensor parallelism's group size; Horovod starts with the process sets of tp groups and
    data-parallel groups (ctx.tensor), and ctx.data_rank / data_size count replicas, not ranks.
    staggered: some ranks queue collectives while others have none (hvd_runtime.scaling.set_cycle_time).
    """
    import horovod.tensorflow as hvd

    set_cycle_time(cycle_time_ms, gpu=bool(physical_gpus()), staggered=staggered)
    tensor = None
    if tp is None:
        hvd.init(process_sets=process_sets)  # process sets are fixed here (a pipeline's grid)
    else:
        tensor = init_tensor_parallel(hvd, tp)
    device = pin_devices(hvd.local_rank(), hvd.local_size(), threads_per_rank, devices_per_rank or 1,
                         ranks_on_this_machine(hvd.local_size(), hvd.size()))
    seed_everything(seed + hvd.rank())
    return Context(device, tensor, stage_devices=devices_per_rank)
