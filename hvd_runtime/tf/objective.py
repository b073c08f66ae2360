"""The loss and accuracy every generated Keras model trains with: a classifier's and a language model's alike.

A classifier answers (batch, classes) for targets (batch,); a language model (batch, tokens,
vocabulary) for targets (batch, tokens). Both are cross-entropy over the last axis (Keras
computes it in fp32 whatever the policy), and a sample's accuracy is the share of its positions
predicted right, so the loops weight samples the same way for both.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def cross_entropy() -> keras.losses.Loss:
    """Mean cross-entropy over every position of every sample, from logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def accuracy_sum(logits, y) -> tf.Tensor:
    """The sum over samples of each sample's share of positions predicted right (float64)."""
    hits = tf.cast(tf.equal(tf.argmax(logits, axis=-1), tf.cast(y, tf.int64)), tf.float64)
    return tf.reduce_sum(tf.reduce_mean(tf.reshape(hits, (tf.shape(hits)[0], -1)), axis=1))


def accuracy(logits, y) -> dict[str, tf.Tensor]:
    """A pipeline engine's metrics_fn: the batch's mean accuracy, a tensor where it was computed (no host sync)."""
    return {"accuracy": accuracy_sum(logits, y) / tf.cast(tf.shape(y)[0], tf.float64)}
