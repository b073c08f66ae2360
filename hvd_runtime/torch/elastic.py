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

from hvd_runtime.torch.batches import ShardedBatches
from hvd_runtime.torch.context import Context
from hvd_runtime.checkpoint import TrainState, state_fields
from hvd_runtime.elastic_reset import elastic_reset_callback, refuse_if_rank0_refused, share_run_id_at_commit


def make_elastic_state(model: nn.Module, optimizer, state: TrainState, ctx: Context,
                       batches: Sequence[ShardedBatches], writers: Sequence = (), tracker=None):
    """Wrap model, optimizer and `state` for hvd.elastic.run, with the reset callback attached.

    `state` is restore_or_broadcast(..., elastic=True)'s: the first sync sends rank 0's to all.
    `tracker` (start_tracking(..., elastic=True)) follows rank 0 across resets.
    """
    import horovod.torch as hvd

    elastic = hvd.elastic.TorchState(model=model, optimizer=optimizer, **state_fields(state),
                                     refusal=getattr(state, "refusal", None))
    elastic.register_reset_callbacks([elastic_reset_callback(ctx, elastic, batches, writers, tracker=tracker)])
    if tracker is not None:
        share_run_id_at_commit(elastic, ctx, tracker, hvd.broadcast_object)
    return elastic


def run_elastic(fit: Callable, elastic_state):
    """hvd.elastic.run: call `fit(state)`, and again after every reset, until it returns."""
    import horovod.torch as hvd

    def attempt(state):
        refuse_if_rank0_refused(state)
        return fit(state)

    return hvd.elastic.run(attempt)(elastic_state)
