"""Cross-entropy and accuracy of logits split over the vocabulary, for Keras 3.

The TensorFlow side of `hvd_runtime.torch.vocab_parallel` (see there for the arithmetic): a head
split by `apply_tp` answers this rank's vocabulary rows of the logits, and the softmax's pieces
are summed over the tensor-parallel group instead of gathering the logits. The sum is Megatron's
g (`sum_over_group`, identity backward), so the tape gives each rank softmax - one-hot on its rows.

    objective = VocabObjective.of(group, vocab)     # Keras' cross-entropy and plain accuracy for tp 1
    loss = objective.cross_entropy(y, logits)       # a Keras loss's argument order
    correct = objective.accuracy_sum(logits, y)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
import tensorflow as tf

from hvd_runtime.parallel.tensor_groups import TensorGroup, VocabularyShare
from hvd_runtime.tf import objective
from hvd_runtime.tf.tensor_parallel import sum_over_group

__all__ = ["VocabObjective"]


def _reduce(tensor, op_name: str, group: TensorGroup, name: str):
    import horovod.tensorflow as hvd

    return hvd.allreduce(tensor, op=getattr(hvd, op_name), process_set=group.process_set, name=name)


@dataclass(frozen=True)
class VocabObjective(VocabularyShare):
    """The training loss and accuracy of one rank's logits: whole, or its rows of a split vocabulary."""

    whole: keras.losses.Loss = field(default_factory=objective.cross_entropy, compare=False, repr=False)

    def cross_entropy(self, y, logits):
        """Mean cross-entropy over every position, as hvd_runtime.tf.objective.cross_entropy() (fp32)."""
        if self.group is None:
            return self.whole(y, logits)
        rows = self.rows
        logits = tf.cast(tf.reshape(logits, (-1, tf.shape(logits)[-1])), tf.float32)
        y = tf.reshape(tf.cast(y, tf.int64), (-1,))
        top = tf.stop_gradient(_reduce(tf.reduce_max(logits, axis=-1), "Max", self.group, "tp.ce.max"))
        shifted = logits - top[:, None]
        mine = tf.logical_and(y >= rows.start, y < rows.stop)
        local = tf.clip_by_value(y - rows.start, 0, rows.stop - rows.start - 1)
        picked = tf.gather(shifted, local, batch_dims=1) * tf.cast(mine, tf.float32)
        sums = sum_over_group(tf.stack([tf.reduce_sum(tf.exp(shifted), axis=-1), picked]), self.group)
        return tf.reduce_mean(tf.math.log(sums[0]) - sums[1])

    def accuracy_sum(self, logits, y):
        """The sum over samples of each sample's share of positions predicted right (float64)."""
        if self.group is None:
            return objective.accuracy_sum(logits, y)
        logits = tf.stop_gradient(tf.cast(logits, tf.float32))
        local_top, local_first = tf.reduce_max(logits, axis=-1), tf.argmax(logits, axis=-1)
        top = _reduce(local_top, "Max", self.group, "tp.accuracy.max")
        # The first id holding the largest logit: this rank's first, where its largest is the largest.
        mine = tf.where(local_top == top, local_first + self.rows.start, tf.cast(self.vocab, tf.int64))
        first = _reduce(mine, "Min", self.group, "tp.accuracy.first")
        hits = tf.cast(tf.equal(first, tf.cast(y, tf.int64)), tf.float64)
        return tf.reduce_sum(tf.reduce_mean(tf.reshape(hits, (tf.shape(hits)[0], -1)), axis=1))

    def accuracy(self, logits, y) -> dict[str, tf.Tensor]:
        """A pipeline engine's metrics_fn: the batch's mean accuracy, left where it was computed."""
        return {"accuracy": self.accuracy_sum(logits, y) / tf.cast(tf.shape(y)[0], tf.float64)}
