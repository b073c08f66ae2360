"""model-split for Keras: one worker's model cut into stages on its own devices; Horovod DP across workers.

    ctx = init_horovod(seed, devices_per_rank=2)      # 2 GPUs per rank, or 2 logical CPU devices
    split = ModelSplit(model, stages=2, micro_batches=4)
    TrainStep(split, optimizer, loss_fn, sync)          # used wherever the model was

Each stage's layers run under `tf.device` of their own device, so TensorFlow moves activations
from device to device between stages (and gradients back). With micro_batches > 1 the batch is
cut into chunks issued as a wavefront (stage s works on chunk i while stage s+1 works on chunk
i-1): inside a tf.function the chunks of different stages have no data dependency, so on GPUs
they run concurrently. The output is the whole batch's, so the loss and gradients are exactly
those of the whole model (BatchNorm aside: it sees one chunk at a time).

The split holds no variables of its own: `variables` are the model's, in the model's order, so
checkpoints, the broadcast of rank 0's weights and the exported model are the whole model's.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from hvd_runtime.devices import local_rank_and_size, stage_gpus
from hvd_runtime.pipeline.partition import Partition
from hvd_runtime.tf.stage import build_stage, plan_stages


def split_devices(stages: int, local_rank: int | None = None, local_size: int | None = None) -> list[str]:
    """One device per stage: this rank's share of the host's GPUs, else its logical CPU devices, else CPU:0.

    Which GPUs is hvd_runtime.devices' decision, on the host's GPU count: too few GPUs is a
    TooFewGpus config error, not a quiet fall back to the CPU. `init_horovod(devices_per_rank=stages)`
    may already have hidden the other ranks' GPUs, so each chosen GPU is named by its place among
    the GPUs this process still sees.
    """
    if local_rank is None or local_size is None:
        local_rank, local_size = local_rank_and_size("horovod.tensorflow")
    physical = tf.config.list_physical_devices("GPU")
    gpus = stage_gpus(stages, local_rank, local_size, len(physical))
    if gpus is not None:
        visible = tf.config.get_visible_devices("GPU")
        hidden = [physical[g].name for g in gpus if physical[g] not in visible]
        if hidden:
            raise RuntimeError(f"this rank's stage GPUs {', '.join(hidden)} were hidden from TensorFlow: "
                               f"start with init_horovod(devices_per_rank={stages})")
        return [f"/GPU:{visible.index(physical[g])}" for g in gpus]
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) >= stages:
        return [f"/CPU:{k}" for k in range(stages)]
    return ["/CPU:0"] * stages


class ModelSplit:
    """The model's layers in `stages` groups, each on its device; calling it moves activations along.

    A batch is cut into min(micro_batches, its size) micro-batches, a number fixed when a step is
    traced: a step traced for any batch size cuts every batch into micro_batches, so a batch
    smaller than that would make empty micro-batches (and BatchNorm's statistics of an empty one
    are NaN). TrainStep traces its steps once for every batch of at least micro_batches samples
    (`min_batch_for_any_size`) and once per size below.
    """

    def __init__(self, model, stages: int = 2, devices: Sequence[str] | None = None,
                 partition: Partition | str | Sequence = "params", micro_batches: int = 1, sample=None,
                 tail=None):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.model = model
        self.plan = plan_stages(model, stages, partition, sample, tail)
        self.devices = list(devices) if devices is not None else split_devices(stages)
        if len(self.devices) != stages:
            raise ValueError(f"got {len(self.devices)} devices for {stages} stages: give one device per stage")
        self.micro_batches = micro_batches
        self.min_batch_for_any_size = micro_batches   # hvd_runtime.tf.step.TrainStep: smaller batches traced per size
        self.stages = [build_stage(model, k, self.plan) for k in range(stages)]

    def __call__(self, x, training: bool = False):
        n = x.shape[0]
        m = min(self.micro_batches, n) if n is not None else self.micro_batches
        if m > 1:
            batch = tf.shape(x)[0]
            if n is None:  # traced for any batch size (not by TrainStep): refuse one that leaves a micro-batch empty
                tf.debugging.assert_greater_equal(batch, m, message=f"a batch smaller than micro_batches={m} "
                                                  "reached ModelSplit traced for any batch size: trace per size")
            sizes = batch // m + tf.cast(tf.range(m) < batch % m, batch.dtype)
            chunks = tf.split(x, sizes, num=m)
        else:
            chunks = [x]
        p = len(self.stages)
        # wavefront: at tick t, stage s runs chunk t - s
        for t in range(m + p - 1):
            for s in reversed(range(p)):
                i = t - s
                if 0 <= i < m:
                    with tf.device(self.devices[s]):
                        chunks[i] = self.stages[s](chunks[i], training=training)
        return tf.concat(chunks, axis=0) if m > 1 else chunks[0]

    # what the training loop, checkpoints and the broadcast use: the whole model's own
    @property
    def variables(self) -> list:
        return self.model.variables

    @property
    def trainable_variables(self) -> list:
        return self.model.trainable_variables

    @property
    def losses(self) -> list:
        return self.model.losses
