"""`model.fit` under Horovod on Keras 3: Keras's own train step, with the allreduce put back in.

A check of the runtime's GradientSync under Keras's own loop (tf_dp_checks.py), not a part of
generated projects, which train through hvd_runtime.tf.step.TrainStep.

Horovod's Keras optimizer wrapper hooks methods Keras 3 no longer calls, so `fit` trains each
rank alone. Keras 3's train step does call `optimizer.apply_gradients`; wrapping that one method
of the compiled model's optimizer adds the same GradientSync the custom loop uses, and leaves
losses, metrics and callbacks to Keras. Data must be this rank's shard, with the same number of
batches on every rank (ShardedBatches.batches gives both).
"""

from __future__ import annotations

import keras

from hvd_runtime.tf.checkpoint import shared_variables
from hvd_runtime.tf.gradients import GradientSync


def distribute_fit(model: keras.Model, sync: GradientSync) -> keras.Model:
    """Make `model.fit` allreduce gradients; call after `model.compile()`, use only with `fit`."""
    optimizer = model.optimizer
    if optimizer is None:
        raise ValueError("distribute_fit needs a compiled model: call model.compile(optimizer=..., loss=...) first")
    keras_apply = optimizer.apply_gradients

    def apply_gradients(grads_and_vars):
        grads, variables = zip(*grads_and_vars)
        # Horovod: average gradients across ranks before Keras applies them.
        return keras_apply(zip(sync(list(grads), list(variables)), variables))

    optimizer.apply_gradients = apply_gradients
    model.jit_compile = False  # Horovod's ops have no XLA kernels in this build
    return model


class BroadcastVariables(keras.callbacks.Callback):
    """Before the first step, every rank takes rank 0's weights and optimizer state."""

    def on_train_begin(self, logs=None):
        import horovod.tensorflow as hvd

        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        # Horovod: start every rank from rank 0's variables.
        hvd.broadcast_variables([v.value for v in shared_variables(self.model, optimizer)], root_rank=0)


class AverageMetrics(keras.callbacks.Callback):
    """Each rank's Keras metrics see only its shard; average the epoch's logs over ranks.

    Put it first in `callbacks=`, so checkpoint and early-stopping callbacks see the averages.
    """

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd
        import tensorflow as tf

        if not logs:
            return
        names = sorted(k for k, v in logs.items() if isinstance(v, (int, float)))
        # Horovod: one allreduce for all of the epoch's numbers.
        values = hvd.allreduce(tf.constant([float(logs[k]) for k in names], tf.float64), op=hvd.Average,
                               name="fit_epoch_logs").numpy()
        logs.update({k: float(v) for k, v in zip(names, values)})
