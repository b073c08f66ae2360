"""Elastic training: the job goes on when a worker dies, rolled back to the last commit.

Horovod's TorchState keeps the model, the optimizer and the TrainState fields (epoch, step,
samples_in_epoch, run_id); `state.commit()` snapshots them in memory. When a rank is lost, the
survivors restore that snapshot, agree on a new rank numbering, and the reset callback here
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


def make_elastic_state(model: nn.Module, optimizer, state: TrainState, ctx: Context,
                       batches: Sequence[ShardedBatches], writers: Sequence = ()):
    """Wrap model, optimizer and `state` for hvd.elastic.run, with the reset callback attached."""
    import horovod.torch as hvd

    elastic = hvd.elastic.TorchState(model=model, optimizer=optimizer, **state_fields(state))

    def on_reset() -> None:
        for b in batches:
            b.reshard(ctx.rank, ctx.size)
        for writer in writers:
            writer.is_writer = ctx.is_root
        if ctx.is_root:
            print(f"elastic reset: {ctx.size} rank(s) now; continuing from the last commit: epoch {elastic.epoch}, "
                  f"step {elastic.step}, {elastic.samples_in_epoch} samples into the epoch", flush=True)

    elastic.register_reset_callbacks([on_reset])
    return elastic


def run_elastic(fit: Callable, elastic_state):
    """hvd.elastic.run: call `fit(state)`, and again after every reset, until it returns."""
    import horovod.torch as hvd

    return hvd.elastic.run(fit)(elastic_state)
