"""Per-rank mini-batches as tf.data pipelines: over in-memory arrays, or read from disk in parallel.

Shards come from hvd_runtime.data.EpochShards, exactly as for PyTorch: disjoint, and padded for
training so that every rank takes the same number of steps (a rank that stops early would leave
the others waiting in an allreduce forever). Progress through an epoch is counted in samples
consumed across all ranks, so a resumed job carries on exactly where the epoch stopped.
In-memory arrays become tensors once; per epoch only an index vector is new, gathered inside
the pipeline. A streamed split (an image folder) is read by a parallel map over batches of
indices: the split's `take` runs in tf.data's threads (decoding releases the GIL), prefetched.
"""

from __future__ import annotations

import tensorflow as tf

from hvd_runtime.data import EpochShards, Split


class ShardedBatches(EpochShards):
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0, train: bool = True):
        super().__init__(len(split), batch_size, rank, size, seed=seed, train=train)
        self.split = split
        if not split.streamed:
            self.x = tf.constant(split.x)
            self.y = tf.constant(split.y)

    def batches(self, epoch: int = 0, consumed: int = 0) -> tf.data.Dataset:
        """This rank's batches of `epoch`, after the first `consumed` samples of its order."""
        indices = tf.data.Dataset.from_tensor_slices(self.indices(epoch, consumed)).batch(self.batch_size)
        if self.split.streamed:
            return indices.map(self._reader(epoch), num_parallel_calls=tf.data.AUTOTUNE,
                               deterministic=True).prefetch(tf.data.AUTOTUNE)
        x, y = self.x, self.y
        return indices.map(lambda i: (tf.gather(x, i), tf.gather(y, i))).prefetch(tf.data.AUTOTUNE)

    def _reader(self, epoch: int):
        split, shape, x_dtype = self.split, self.split.sample_shape, tf.as_dtype(self.split.input_dtype)

        def read(i):
            x, y = tf.numpy_function(lambda idx: split.take(idx, epoch), [i], [x_dtype, tf.int64], stateful=False)
            return tf.ensure_shape(x, (None, *shape)), tf.ensure_shape(y, (None, *split.target_shape))
        return read

    def __iter__(self):
        return iter(self.batches())
