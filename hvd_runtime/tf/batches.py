"""Per-rank mini-batches as tf.data pipelines: over in-memory arrays, or read from disk in parallel.

Shards come from hvd_runtime.data.EpochShards, exactly as for PyTorch: disjoint, and padded for
training so that every rank takes the same number of steps (a rank that stops early would leave
the others waiting in an allreduce forever). Progress through an epoch is counted in samples
consumed across all ranks, so a resumed job carries on exactly where the epoch stopped.
In-memory arrays become tensors once; per epoch only an index vector is new, gathered inside
the pipeline. A streamed split (an image folder) is read by a parallel map over batches of
indices: the split's `take` runs in tf.data's threads (decoding releases the GIL), prefetched. A
file that turns unreadable mid-training stops the job with its one-line DataError.

tf.data's autotuning is off (READERS and PREFETCH say what it would have tuned). Autotuning
starts a model thread with each iterator, and an epoch's iterator is freed when the epoch ends:
the free waits for that thread, which sleeps out its optimization interval first. At a streamed
epoch's end that held one rank for about 2.4 s in about half the epochs, the others waiting in
the epoch's metrics allreduce (TensorFlow 2.21, ResNet-18 over an image folder, 2 ranks on 2
CPU cores: 361 images/s in those epochs, 660-700 in the others); without it, 657-681 in every
epoch. Validation sets, read once per epoch, paid it too.
"""

from __future__ import annotations

from typing import Iterator

import tensorflow as tf

from hvd_runtime.data import DataError, EpochShards, Split

PREFETCH = 2   # batches ready ahead of the step
# Batches read from disk at once: tf.data.AUTOTUNE, which with autotuning off means one per core
# of tf.data's thread pool, which reads as fast as autotuning does here.
READERS = tf.data.AUTOTUNE


# tf.data traces a map function through AutoGraph, which rewrites it from its source first; these
# trace as written (hvd_runtime.tf.compiled says why nothing of the runtime needs AutoGraph).
_as_written = tf.autograph.experimental.do_not_convert


def _without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def split_reader(split: Split, epoch: int = 0, failures: list | None = None):
    """A tf.data map function: a batch of indices -> the split's (x, y) for them, read by its `take`
    in tf.data's thread (decoding releases the GIL). A read that fails puts its DataError in
    `failures`, whole: TensorFlow would wrap it in an op error and a traceback."""
    shape, x_dtype = split.sample_shape, tf.as_dtype(split.input_dtype)
    failures = [] if failures is None else failures

    def take(idx):
        try:
            return split.take(idx, epoch)
        except DataError as exc:
            failures.append(exc)
            raise

    @_as_written
    def read(i):
        x, y = tf.numpy_function(take, [i], [x_dtype, tf.int64], stateful=False)
        return tf.ensure_shape(x, (None, *shape)), tf.ensure_shape(y, (None, *split.target_shape))
    return read


class ShardedBatches(EpochShards):
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0, train: bool = True):
        super().__init__(len(split), batch_size, rank, size, seed=seed, train=train)
        self.split = split
        if not split.streamed:
            self.x = tf.constant(split.x)
            self.y = tf.constant(split.y)

    def batches(self, epoch: int = 0, consumed: int = 0) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """This rank's batches of `epoch`, after the first `consumed` samples of its order."""
        failures: list[DataError] = []
        dataset = self.dataset(epoch, consumed, failures)
        return self._stop_on_data_errors(dataset, failures) if self.split.streamed else iter(dataset)

    def dataset(self, epoch: int = 0, consumed: int = 0, failures: list | None = None) -> tf.data.Dataset:
        """The tf.data.Dataset `batches` iterates; a streamed split's reads put a DataError in `failures`."""
        indices = tf.data.Dataset.from_tensor_slices(self.indices(epoch, consumed)).batch(self.batch_size)
        indices = _without_autotune(indices)
        if self.split.streamed:
            return indices.map(split_reader(self.split, epoch, failures), deterministic=True,
                               num_parallel_calls=READERS).prefetch(PREFETCH)
        x, y = self.x, self.y
        return indices.map(_as_written(lambda i: (tf.gather(x, i), tf.gather(y, i)))).prefetch(PREFETCH)

    @staticmethod
    def _stop_on_data_errors(dataset: tf.data.Dataset, failures: list) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        try:
            yield from dataset
        except tf.errors.OpError:
            if failures:
                raise failures[0] from None  # a file gone bad since start-up: one config-error line
            raise

    def __iter__(self):
        return self.batches()
