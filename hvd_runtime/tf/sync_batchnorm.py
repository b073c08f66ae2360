"""BatchNormalization with statistics over the global batch, for Keras 3.

Horovod's `hvd.SyncBatchNormalization` passes `fused=`, which Keras 3's BatchNormalization no
longer accepts, and Keras 3's own `synchronized=True` reduces only across a tf.distribute
strategy's replicas, not across Horovod ranks. This layer keeps everything of Keras's layer and
replaces how the batch moments are taken: each rank sums its count, sum and sum of squares, one
allreduce adds them up, and the mean and variance follow. Horovod's allreduce has a gradient
(the allreduce of the incoming gradients), so the backward pass is global too.
"""

from __future__ import annotations

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="hvd_runtime")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    def _moments(self, inputs, mask):
        if mask is not None:
            raise ValueError(f"{self.name}: SyncBatchNormalization does not support masked inputs")
        import horovod.tensorflow as hvd

        x = tf.cast(inputs, tf.float32)
        axes = list(self._reduction_axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), tf.float32)
        local = tf.concat([tf.reshape(count, [1]), tf.reduce_sum(x, axes), tf.reduce_sum(tf.square(x), axes)], 0)
        # Horovod: one allreduce for count, sum and sum of squares of every rank's batch.
        total = hvd.allreduce(local, op=hvd.Sum, name=f"sync_batchnorm.{self.name}")
        n = total[0]
        channels = (tf.shape(total)[0] - 1) // 2
        mean = total[1:1 + channels] / n
        variance = tf.maximum(total[1 + channels:] / n - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


def use_sync_batchnorm(model: keras.Model) -> keras.Model:
    """A copy of `model` with every BatchNormalization made a SyncBatchNormalization.

    The model's own code stays as it is; its current weights are carried over. A layer of the
    model's own (a residual block) is rebuilt from its config, so its BatchNormalization layers are
    new objects of the copy: those change class in place, which is safe because
    SyncBatchNormalization adds no state, only another way of taking the batch moments.
    """

    def swap(layer):
        if type(layer) is keras.layers.BatchNormalization:
            return SyncBatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    synced = keras.models.clone_model(model, clone_function=swap, recursive=True)
    for layer in synced._flatten_layers(include_self=False):
        if type(layer) is keras.layers.BatchNormalization:
            layer.__class__ = SyncBatchNormalization
    synced.set_weights(model.get_weights())
    return synced
