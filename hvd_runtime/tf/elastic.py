"""Elastic training for TensorFlow / Keras 3: the job goes on when a worker dies, rolled back to the last commit.

Horovod's own TF states do not fit Keras 3: TensorFlowKerasState calls `optimizer.variables()`,
a list (not a method) in Keras 3, and TensorFlowState broadcasts nothing on sync when eager.
KerasState keeps the model's and optimizer's variables and the TrainState fields (epoch, step,
samples_in_epoch, run_id); `state.commit()` copies them to host memory. When a rank is lost, the
survivors restore that copy, agree on a new numbering, and the reset callback re-shards the
data from the committed position, so within the epoch no sample is skipped or seen twice. The LR
follows the new world size by itself (WarmupSchedule reads it in the step). Rank 0 may change:
everything that writes only on rank 0 is told who rank 0 is now.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState

from hvd_runtime.checkpoint import CheckpointStore, state_fields
from hvd_runtime.elastic_reset import allowing_resets, follow_resets, sync_now
from hvd_runtime.tf.batches import ShardedBatches
from hvd_runtime.tf.broadcast import broadcast_variables
from hvd_runtime.tf.context import Context
from hvd_runtime.tf.checkpoint import restore_on_root, shared_variables
from hvd_runtime.tf.step import TrainStep


class KerasState(ObjectState):
    """A TrainStep's model, optimizer and gradient accumulator, plus plain fields, for hvd.elastic.

    Commit copies every variable to NumPy; restore assigns the copies back (an accumulator is
    always empty at a commit, so a half-accumulated step is dropped too); sync broadcasts rank
    0's shared variables, as at start-up, and then its fields.
    """

    def __init__(self, train_step: TrainStep, /, **fields):
        import horovod.tensorflow as hvd

        model, optimizer = train_step.model, train_step.optimizer
        self.optimizer = optimizer
        local = [v for v in model.variables if train_step.sync.is_local(v)]
        self._shared = [v.value for v in shared_variables(model, optimizer, local)]
        accumulated = train_step.accumulator.sums if train_step.accumulator else []
        self._variables = [*model.variables, *optimizer.variables, *accumulated]
        self._values = self._copy()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **fields)

    def _copy(self) -> list[np.ndarray]:
        return [np.array(v) for v in self._variables]

    def save(self) -> None:
        self._values = self._copy()
        super().save()

    def restore(self) -> None:
        for v, value in zip(self._variables, self._values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        # Horovod: every rank goes on from rank 0's variables.
        broadcast_variables(self._shared, root_rank=0)
        self._values = self._copy()
        super().sync()


def start_elastic(store: CheckpointStore, model, step: TrainStep, ctx: Context, resume: bool = True) -> KerasState:
    """The elastic state of the step's model and optimizer and where training stands, synced now.

    `model` is the model as checkpoints hold it (the step's may be split over devices).

    Rank 0 loads its latest checkpoint (if any) alone; this first sync sends it to every rank, as
    the sync after a reset sends it to workers that join later, so a joiner never meets a
    start-up broadcast the others are not in. If it does not fit the model, every rank stops
    here with rank 0's line, before anything is written. The run's own first sync is then skipped.
    """
    start = restore_on_root(store, model, step.optimizer, ctx, resume)
    elastic = KerasState(step, **state_fields(start), refusal=start.refusal)
    sync_now(elastic)
    return elastic


_COLLECTIVE = re.compile(r"horovod|gloo|nccl", re.IGNORECASE)


def _lost_peer(exc: BaseException) -> bool:
    """A Horovod collective that failed because a peer is gone, not a bug in the model.

    Horovod reports those as UnknownError; inside a tf.function the message names the node
    (here "gradients") and Gloo's transport error, with Horovod's frames in the traceback.
    """
    return isinstance(exc, tf.errors.UnknownError) and bool(_COLLECTIVE.search(exc.message or ""))


def run_elastic(fit: Callable, elastic_state: KerasState, ctx: Context, batches: Sequence[ShardedBatches],
                writers: Sequence = (), tracker=None):
    """hvd.elastic.run for Keras 3: call `fit(state)`, and again after every reset, until it returns.

    After a reset the data is re-sharded, `writers` and `tracker` (start_tracking(..., elastic=True))
    follow rank 0, and rank 0 says where training goes on, with the LR (it follows the world size).

    Horovod's TF wrapper looks for op names such as "HorovodAllreduce" in the message, which a
    grouped allreduce inside a tf.function does not carry, and then returns None as if training
    had finished. Here every failed collective means a reset, and any other error is raised.
    """
    import horovod.tensorflow as hvd
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError

    def learning_rate() -> str:
        return f"; lr {float(elastic_state.optimizer.learning_rate):.6g}"

    follow_resets(elastic_state, ctx, batches, writers, tracker, hvd.broadcast_object, learning_rate)
    fit = allowing_resets(fit)

    def attempt(state):
        try:
            return fit(state)
        except tf.errors.UnknownError as exc:
            if _lost_peer(exc):
                raise HorovodInternalError(exc) from exc
            raise

    def reset() -> None:
        # Only Horovod restarts: TF's devices and thread pools stay as init_horovod set them.
        hvd.shutdown()
        hvd.init()

    return run_fn(attempt, reset)(elastic_state)
