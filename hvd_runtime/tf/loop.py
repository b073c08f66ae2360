"""One epoch of training and one pass of evaluation, with metrics averaged over all ranks."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from hvd_runtime.progress import progress
from hvd_runtime.throughput import Throughput
from hvd_runtime.tf.batches import ShardedBatches
from hvd_runtime.tf.buffers import average_statistics
from hvd_runtime.tf.context import Context
from hvd_runtime.tf.objective import accuracy_sum
from hvd_runtime.tf.state import TrainState
from hvd_runtime.tf.step import TrainStep


@dataclass(frozen=True)
class Every:
    """Run `action()` after every `steps` training steps (0 = never), on every rank at once."""

    steps: int
    action: Callable[[], object]


def allreduce_sums(sums: dict[str, tf.Tensor], count) -> dict[str, float]:
    """Global means: sum every rank's totals and counts in one allreduce, then divide.

    Averaging per-rank means would weight a rank's last, shorter shard like a full one.
    """
    import horovod.tensorflow as hvd

    stacked = tf.stack([*(tf.cast(v, tf.float64) for v in sums.values()), tf.cast(count, tf.float64)])
    totals = hvd.allreduce(stacked, op=hvd.Sum, name="metric_sums").numpy()
    if totals[-1] == 0:  # an epoch resumed at its very end trained nothing
        return {name: float("nan") for name in sums}
    return {name: float(totals[i] / totals[-1]) for i, name in enumerate(sums)}


def train_epoch(step: TrainStep, batches: ShardedBatches, ctx: Context, state: TrainState, log_every: int = 0,
                on_log: Callable[[dict[str, float], int], None] | None = None,
                every: Sequence[Every] = ()) -> dict[str, float]:
    """Train the rest of epoch `state.epoch`; return loss and accuracy averaged over ranks, and speed.

    `state` advances as it goes: `step`, and `samples_in_epoch`, from which a resumed job
    continues; at the end of the epoch `epoch` moves on and `samples_in_epoch` returns to 0.
    With backward_passes_per_step = k the epoch is trimmed to a multiple of k, so no
    half-accumulated step is left over; every rank trims the same way, and `every` hooks (a
    mid-epoch checkpoint) run only between optimizer steps. Every `log_every` steps, the batch
    loss averaged over ranks and the throughput since the last point go to `on_log(metrics, step)`.
    """
    k = step.k
    steps = batches.steps(state.samples_in_epoch)
    usable = steps - steps % k
    loss_sum = correct = seen = 0.0
    batch_iter = progress(batches.batches(state.epoch, state.samples_in_epoch), enabled=ctx.is_root,
                          desc=f"epoch {state.epoch}", total=usable)
    speed = Throughput(batches.samples_per_step)
    for i, (x, y) in enumerate(batch_iter):
        if i >= usable:
            break
        loss, right = step(x, y, apply=(i + 1) % k == 0)
        n = int(y.shape[0])
        loss_sum += float(loss) * n
        correct += float(right)
        seen += n
        state.step += 1
        state.samples_in_epoch += batches.samples_per_step
        speed.tokens_per_sample = int(np.prod(y.shape[1:]))  # a language model's targets: one per token
        speed.step()
        if log_every and on_log and state.step % log_every == 0:
            point = allreduce_sums({"step_train_loss": loss}, 1.0) | speed.since_last()
            if hasattr(batch_iter, "set_postfix_str"):
                batch_iter.set_postfix_str(f"{point['samples_per_s']:.0f} samples/s", refresh=False)
            on_log(point, state.step)
        for hook in every:
            if hook.steps and state.step % hook.steps == 0 and (i + 1) % k == 0:
                hook.action()
    state.epoch += 1
    state.samples_in_epoch = 0
    # Horovod: average over all ranks, not just this one.
    return allreduce_sums({"train_loss": loss_sum, "train_accuracy": correct}, seen) | {
        f"train_{name}": value for name, value in speed.epoch().items()}


_EVAL_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _eval_fn(model, loss_fn):
    """One compiled function per model, so evaluation does not retrace every epoch."""
    cached = _EVAL_FNS.get(model)
    if cached is None or cached[0] is not loss_fn:
        @tf.function(reduce_retracing=True)
        def totals(x, y):
            logits = model(x, training=False)
            return loss_fn(y, logits) * tf.cast(tf.shape(y)[0], tf.float32), accuracy_sum(logits, y)

        cached = _EVAL_FNS[model] = (loss_fn, totals)
    return cached[1]


def evaluate(model, batches: ShardedBatches, loss_fn, ctx: Context) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, each sample counted once on one rank.

    Every rank first takes the job's mean BatchNorm statistics, so all ranks evaluate one model.
    """
    average_statistics(model, name="eval.statistics")
    totals = _eval_fn(model, loss_fn)
    loss_sum = correct = seen = 0.0
    for x, y in batches:
        loss, right = totals(x, y)
        loss_sum += float(loss)
        correct += float(right)
        seen += int(y.shape[0])
    # Horovod: shards are uneven, so sum totals and counts over ranks before dividing.
    return allreduce_sums({"val_loss": loss_sum, "val_accuracy": correct}, seen)
