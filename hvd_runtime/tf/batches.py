"""Per-rank mini-batches as tf.data pipelines over in-memory arrays.

Shards come from hvd_runtime.data.EpochShards, exactly as for PyTorch: disjoint, and padded for
training so that every rank takes the same number of steps (a rank that stops early would leave
the others waiting in an allreduce forever). Progress through an epoch is counted in samples
consumed across all ranks, so a resumed job carries on exactly where the epoch stopped. The
arrays become tensors once; per epoch only an index vector is new, gathered inside the pipeline.
"""

from __future__ import annotations

import tensorflow as tf

from hvd_runtime.data import EpochShards, Split


class ShardedBatches(EpochShards):
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0, train: bool = True):
        super().__init__(len(split), batch_size, rank, size, seed=seed, train=train)
        self.x = tf.constant(split.x)
        self.y = tf.constant(split.y)

    def batches(self, epoch: int = 0, consumed: int = 0) -> tf.data.Dataset:
        """This rank's batches of `epoch`, after the first `consumed` samples of its order."""
        x, y = self.x, self.y
        return (tf.data.Dataset.from_tensor_slices(self.indices(epoch, consumed))
                .batch(self.batch_size)
                .map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
                .prefetch(tf.data.AUTOTUNE))

    def __iter__(self):
        return iter(self.batches())
