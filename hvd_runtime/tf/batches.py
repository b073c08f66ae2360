"""Per-rank mini-batches as tf.data pipelines over in-memory arrays.

Shards come from hvd_runtime.data.shard_indices, exactly as for PyTorch: disjoint, and padded for
training so that every rank takes the same number of steps (a rank that stops early would leave
the others waiting in an allreduce forever). Progress through an epoch is counted in samples
consumed across all ranks, so a resumed job carries on exactly where the epoch stopped. The
arrays become tensors once; per epoch only an index vector is new, gathered inside the pipeline.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from hvd_runtime.data import Split, shard_indices


class ShardedBatches:
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0, train: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.x = tf.constant(split.x)
        self.y = tf.constant(split.y)
        self.samples = len(split)
        self.batch_size, self.seed, self.train = batch_size, seed, train
        self.rank, self.size = rank, size

    @property
    def samples_per_step(self) -> int:
        """Samples of the epoch's order one step consumes, over all ranks."""
        return self.batch_size * self.size

    def steps(self, consumed: int = 0) -> int:
        """Steps left in an epoch of which `consumed` samples are done (the same on every rank)."""
        return math.ceil(math.ceil(max(0, self.samples - consumed) / self.size) / self.batch_size)

    def _indices(self, epoch: int, consumed: int) -> np.ndarray:
        return shard_indices(self.samples, self.rank, self.size, epoch, self.seed,
                             shuffle=self.train, pad=self.train, consumed=consumed)

    def __len__(self) -> int:
        if self.train:
            return self.steps()
        return math.ceil(len(self._indices(0, 0)) / self.batch_size)

    def batches(self, epoch: int = 0, consumed: int = 0) -> tf.data.Dataset:
        """This rank's batches of `epoch`, after the first `consumed` samples of its order."""
        x, y = self.x, self.y
        return (tf.data.Dataset.from_tensor_slices(self._indices(epoch, consumed))
                .batch(self.batch_size)
                .map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
                .prefetch(tf.data.AUTOTUNE))

    def __iter__(self):
        return iter(self.batches())
