"""Elastic training: the job goes on when a worker dies, rolled back to the last commit.

Horovod's TorchState keeps the model, the optimizer and the TrainState fields (epoch, step,
samples_in_epoch, run_id); `state.commit()` snapshots them in memory. When a rank is lost, the
survivors restore that snapshot, agree on a new rank numbering, and the reset callback
re-shards the data from the committed position, so within the epoch no sample is skipped or
seen twice. The LR follows the new world size by itself (WarmupSchedule reads it each step).
Rank 0 may change: everything that writes only on rank 0 is told who rank 0 is now.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from hvd_runtime.checkpoint import CheckpointStore, state_fields
from hvd_runtime.elastic_reset import allowing_resets, follow_resets, sync_now
from hvd_runtime.torch.batches import ShardedBatches
from hvd_runtime.torch.context import Context
from hvd_runtime.torch.checkpoint import restore_on_root


def start_elastic(store: CheckpointStore, model: nn.Module, optimizer, ctx: Context, resume: bool = True):
    """Horovod's elastic state for model, optimizer and where training stands, synced now.

    Rank 0 loads its latest checkpoint (if any) alone; this first sync sends it to every rank, as
    the sync after a reset sends it to workers that join later, so a joiner never meets a
    start-up broadcast the others are not in. If it does not fit the model, every rank stops
    here with rank 0's line, before anything is written. The run's own first sync is then skipped.
    """
    import horovod.torch as hvd

    start = restore_on_root(store, model, optimizer, ctx, resume)
    elastic = hvd.elastic.TorchState(model=model, optimizer=optimizer, **state_fields(start), refusal=start.refusal)
    sync_now(elastic)
    return elastic


def run_elastic(fit: Callable, elastic, ctx: Context, batches: Sequence[ShardedBatches], writers: Sequence = (),
                tracker=None):
    """hvd.elastic.run: call `fit(state)`, and again after every reset, until it returns.

    After a reset the data is re-sharded, `writers` and `tracker` (start_tracking(..., elastic=True))
    follow rank 0, and rank 0 says where training goes on.
    """
    import horovod.torch as hvd

    follow_resets(elastic, ctx, batches, writers, tracker, hvd.broadcast_object)
    return hvd.elastic.run(allowing_resets(fit))(elastic)
