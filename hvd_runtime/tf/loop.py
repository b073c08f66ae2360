"""One epoch of training and one pass of evaluation, with metrics averaged over all ranks."""

from __future__ import annotations

import weakref
from typing import Callable

import tensorflow as tf

from hvd_runtime.progress import progress
from hvd_runtime.tf.batches import ShardedBatches
from hvd_runtime.tf.context import Context
from hvd_runtime.tf.state import TrainState
from hvd_runtime.tf.step import TrainStep


def allreduce_sums(sums: dict[str, tf.Tensor], count) -> dict[str, float]:
    """Global means: sum every rank's totals and counts in one allreduce, then divide.

    Averaging per-rank means would weight a rank's last, shorter shard like a full one.
    """
    import horovod.tensorflow as hvd

    stacked = tf.stack([*(tf.cast(v, tf.float64) for v in sums.values()), tf.cast(count, tf.float64)])
    totals = hvd.allreduce(stacked, op=hvd.Sum, name="metric_sums").numpy()
    return {name: float(totals[i] / totals[-1]) for i, name in enumerate(sums)}


def train_epoch(step: TrainStep, batches: ShardedBatches, ctx: Context, state: TrainState, log_every: int = 0,
                on_log: Callable[[dict[str, float], int], None] | None = None) -> dict[str, float]:
    """Train one epoch (state.epoch), advancing state.step; return averaged loss and accuracy.

    With backward_passes_per_step = k the epoch is trimmed to a multiple of k, so no
    half-accumulated step is left over; every rank trims the same way.
    Every `log_every` steps, the batch loss averaged over ranks goes to `on_log(metrics, step)`.
    """
    batches.set_epoch(state.epoch)
    k = step.k
    usable = max(k, len(batches) - len(batches) % k)
    loss_sum = correct = seen = 0.0
    for i, (x, y) in enumerate(progress(batches, enabled=ctx.is_root, desc=f"epoch {state.epoch}", total=usable)):
        if i >= usable:
            break
        loss, right = step(x, y, apply=(i + 1) % k == 0)
        n = int(y.shape[0])
        loss_sum += float(loss) * n
        correct += float(right)
        seen += n
        state.step += 1
        if log_every and on_log and state.step % log_every == 0:
            on_log(allreduce_sums({"step_train_loss": loss}, 1.0), state.step)
    # Horovod: average over all ranks, not just this one.
    return allreduce_sums({"train_loss": loss_sum, "train_accuracy": correct}, seen)


_EVAL_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _eval_fn(model, loss_fn):
    """One compiled function per model, so evaluation does not retrace every epoch."""
    cached = _EVAL_FNS.get(model)
    if cached is None or cached[0] is not loss_fn:
        @tf.function(reduce_retracing=True)
        def totals(x, y):
            logits = model(x, training=False)
            right = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1), tf.cast(y, tf.int64)), tf.float64))
            return loss_fn(y, logits) * tf.cast(tf.shape(y)[0], tf.float32), right

        cached = _EVAL_FNS[model] = (loss_fn, totals)
    return cached[1]


def evaluate(model, batches: ShardedBatches, loss_fn, ctx: Context) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, each sample counted once on one rank."""
    totals = _eval_fn(model, loss_fn)
    loss_sum = correct = seen = 0.0
    for x, y in batches:
        loss, right = totals(x, y)
        loss_sum += float(loss)
        correct += float(right)
        seen += int(y.shape[0])
    # Horovod: shards are uneven, so sum totals and counts over ranks before dividing.
    return allreduce_sums({"val_loss": loss_sum, "val_accuracy": correct}, seen)
