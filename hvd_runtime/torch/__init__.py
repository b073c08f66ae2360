"""hvd_runtime for PyTorch: everything a data-parallel train.py calls, one concern per module."""

from hvd_runtime.torch.batches import ShardedBatches
from hvd_runtime.torch.context import Context, init_horovod
from hvd_runtime.torch.loop import allreduce_sums, evaluate, train_epoch
from hvd_runtime.torch.optim import make_optimizer
from hvd_runtime.torch.sync_batchnorm import SyncBatchNorm, use_sync_batchnorm
from hvd_runtime.torch.state import TrainState, restore_or_broadcast, save_checkpoint

__all__ = ["Context", "ShardedBatches", "SyncBatchNorm", "TrainState", "allreduce_sums", "evaluate", "init_horovod",
           "make_optimizer", "restore_or_broadcast", "save_checkpoint", "train_epoch", "use_sync_batchnorm"]
