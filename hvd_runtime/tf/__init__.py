"""hvd_runtime for TensorFlow / Keras 3: what a data-parallel train.py calls, one concern per module.

Built on `horovod.tensorflow` (collectives) and plain Keras 3 (model, optimizer), with the
gradient allreduce as an explicit step in a custom loop (or, for `model.fit`, wrapped around the
optimizer's apply_gradients); the epoch loop is hvd_runtime.loop's, driving a TrainStep.
`horovod.tensorflow.keras` is not used: on Keras 3 its optimizer
wrapper is silently bypassed and its callbacks fail.
"""

from hvd_runtime.collector import collector_paused

with collector_paused():  # every rank of a host loads TensorFlow, Keras and Horovod at once (hvd_runtime.collector)
    from hvd_runtime.tf.lean_import import import_tensorflow

    import_tensorflow()  # before any module below imports it: without the packages only Keras' extras use

    from hvd_runtime.tf.batches import ShardedBatches
    from hvd_runtime.tf.context import Context, init_horovod
    from hvd_runtime.tf.grid import init
    from hvd_runtime.tf.gradients import GradientAccumulator, GradientSync
    from hvd_runtime.tf.objective import accuracy, accuracy_sum, cross_entropy
    from hvd_runtime.tf.optim import WarmupSchedule, make_optimizer
    from hvd_runtime.tf.precision import loss_scaled, use_precision
    from hvd_runtime.checkpoint import TrainState
    from hvd_runtime.tf.checkpoint import checkpoint_store, restore_checkpoint, save_checkpoint
    from hvd_runtime.tf.step import TrainStep
    from hvd_runtime.tf.sync_batchnorm import SyncBatchNormalization, use_sync_batchnorm

__all__ = ["Context", "GradientAccumulator", "GradientSync",
           "ShardedBatches", "SyncBatchNormalization", "TrainState", "TrainStep", "WarmupSchedule", "accuracy",
           "accuracy_sum", "checkpoint_store", "cross_entropy", "init", "init_horovod", "loss_scaled",
           "make_optimizer", "restore_checkpoint", "save_checkpoint", "use_precision", "use_sync_batchnorm"]
