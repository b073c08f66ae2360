"""hvd_runtime for PyTorch: everything a train.py calls that is bound to torch, one concern per module.

The epoch loop itself is framework-free: hvd_runtime.loop, driving a TrainStep or a PipelineEngine.
"""

from hvd_runtime.collector import collector_paused

with collector_paused():  # every rank of a host loads torch and Horovod at once (hvd_runtime.collector)
    from hvd_runtime.torch.batches import ShardedBatches
    from hvd_runtime.torch.checkpoint import TrainState, checkpoint_store, restore_checkpoint, save_checkpoint
    from hvd_runtime.torch.context import Context, init_horovod
    from hvd_runtime.torch.grid import init
    from hvd_runtime.torch.elastic import run_elastic, start_elastic
    from hvd_runtime.torch.meta_init import build_on_meta
    from hvd_runtime.torch.objective import accuracy, cross_entropy
    from hvd_runtime.torch.optim import WarmupSchedule, make_optimizer
    from hvd_runtime.torch.precision import Precision
    from hvd_runtime.torch.step import TrainStep
    from hvd_runtime.torch.sync_batchnorm import SyncBatchNorm, use_sync_batchnorm

__all__ = ["Context", "Precision", "ShardedBatches", "SyncBatchNorm", "TrainState", "TrainStep", "WarmupSchedule",
           "accuracy", "build_on_meta", "checkpoint_store", "cross_entropy", "init", "init_horovod", "start_elastic", "make_optimizer",
           "restore_checkpoint", "run_elastic", "save_checkpoint", "use_sync_batchnorm"]
