"""hvd_runtime for PyTorch: everything a data-parallel train.py calls, one concern per module."""

from hvd_runtime.torch.batches import ShardedBatches
from hvd_runtime.torch.context import Context, init_horovod
from hvd_runtime.torch.elastic import run_elastic, start_elastic
from hvd_runtime.torch.loop import Every, allreduce_sums, evaluate, train_epoch
from hvd_runtime.torch.objective import accuracy, cross_entropy
from hvd_runtime.torch.optim import WarmupSchedule, make_optimizer
from hvd_runtime.torch.precision import Precision
from hvd_runtime.torch.state import TrainState, restore_or_broadcast, save_checkpoint
from hvd_runtime.torch.sync_batchnorm import SyncBatchNorm, use_sync_batchnorm

__all__ = ["Context", "Every", "Precision", "ShardedBatches", "SyncBatchNorm", "TrainState", "WarmupSchedule",
           "accuracy", "allreduce_sums", "cross_entropy", "evaluate", "init_horovod", "start_elastic",
           "make_optimizer", "restore_or_broadcast", "run_elastic", "save_checkpoint", "train_epoch",
           "use_sync_batchnorm"]
