"""Per-rank mini-batches as tf.data pipelines over in-memory arrays.

Shards come from hvd_runtime.data.shard_indices, exactly as for PyTorch: disjoint, and padded for
training so that every rank takes the same number of steps (a rank that stops early would leave
the others waiting in an allreduce forever). The arrays become tensors once; each epoch only
its index vector is new, and batches are gathered from it inside the pipeline.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvd_runtime.data import Split, batch_count, shard_indices


class ShardedBatches:
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0,
                 train: bool = True, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.x = tf.constant(split.x)
        self.y = tf.constant(split.y)
        self.n = len(split)
        self.batch_size, self.rank, self.size = batch_size, rank, size
        self.seed, self.train, self.drop_last = seed, train, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch`, as every rank does with the same seed."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.train:
            return batch_count(self.n, self.size, self.batch_size, self.drop_last)
        return -(-len(self._indices()) // self.batch_size)

    def _indices(self) -> np.ndarray:
        return shard_indices(self.n, self.rank, self.size, self.epoch, self.seed,
                             shuffle=self.train, pad=self.train)

    def dataset(self, start: int = 0) -> tf.data.Dataset:
        """This epoch's batches from batch number `start` on (to resume mid-epoch)."""
        index = self._indices()[start * self.batch_size:len(self) * self.batch_size]
        x, y = self.x, self.y
        return (tf.data.Dataset.from_tensor_slices(index)
                .batch(self.batch_size)
                .map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
                .prefetch(tf.data.AUTOTUNE))

    def __iter__(self):
        return iter(self.dataset())
