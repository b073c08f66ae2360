"""The one epoch loop: every strategy, both frameworks.

A strategy hands the loop a *step*, which knows how to train on one batch; the loop owns
everything around it, the same for a data-parallel model, a split one, a tensor-parallel group or
a pipeline stage: the position in the epoch (exact resume), trimming to whole optimizer steps,
progress, throughput, `log_every` points, `Every` hooks (checkpoints, elastic commits) and the
metrics averaged over the job. A step offers:

    batches_per_update: int        batches whose gradients make one optimizer step (k)
    reports_loss: bool             does this rank's batch count in the job's means? (a pipeline
                                   stage before the last computes no data loss: its batches count
                                   0, and its loss, its layers' penalty terms, only adds in)
    train_batch(x, y, apply, step) -> (mean loss, {metric: sum over the batch})
                                   `apply`: the k-th batch, update the weights; `step`: the
                                   job's batch count so far (a learning-rate schedule reads it)
    evaluate(batches) -> (mean loss, {metric: mean}), over every rank's shard
    sum_over_ranks(values, name) -> values summed over every rank (a float64 vector)

hvd_runtime.torch.TrainStep, hvd_runtime.tf.TrainStep and both PipelineEngines are steps.
Values a step returns may be the framework's tensors: they are added up where they are (no host
sync per batch) and read only at a log point and at the end of the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from hvd_runtime import preemption, watchdog
from hvd_runtime.progress import progress
from hvd_runtime.throughput import Throughput


class Step(Protocol):
    """What the loop drives: see the module's docstring."""

    batches_per_update: int
    reports_loss: bool

    def train_batch(self, x, y, apply: bool, step: int) -> tuple[object, Mapping[str, object]]: ...

    def evaluate(self, batches) -> tuple[float, dict[str, float]]: ...

    def sum_over_ranks(self, values: np.ndarray, name: str) -> np.ndarray: ...


@dataclass(frozen=True)
class Every:
    """Run `action()` after every `steps` training steps (0 = never), on every rank at once."""

    steps: int
    action: Callable[[], object]


def means_over_ranks(sums: Mapping[str, object], count, sum_over_ranks: Callable, name: str) -> dict[str, float]:
    """Global means: every rank's totals and counts summed in one collective, then divided.

    Averaging per-rank means would weight a rank's last, shorter shard like a full one.
    """
    values = np.array([*(float(v) for v in sums.values()), float(count)], dtype=np.float64)
    totals = sum_over_ranks(values, name)
    if totals[-1] == 0:  # an epoch resumed at its very end trained nothing
        return {key: float("nan") for key in sums}
    return {key: float(totals[i] / totals[-1]) for i, key in enumerate(sums)}


def train_epoch(step: Step, batches, state, *, is_root: bool, log_every: int = 0,
                on_log: Callable[[dict[str, float], int], None] | None = None,
                every: Sequence[Every] = (), on_stop: Callable[[], object] | None = None,
                utilization=None) -> dict[str, float]:
    """Train the rest of epoch `state.epoch`; return train_loss and train_<metric> over the job, and speed.

    `state` (a TrainState or Horovod's elastic state) advances as it goes: `step`, and
    `samples_in_epoch`, from which a resumed or resized job continues; at the end of the epoch
    `epoch` moves on and `samples_in_epoch` returns to 0. With k batches per optimizer step the
    epoch is trimmed to a multiple of k, the same on every rank, so no half-accumulated step is
    left over, and `every` hooks run only between optimizer steps. Every `log_every` steps, the
    batch loss over the job and the throughput since the last point go to `on_log(metrics, step)`;
    with rank 0's `utilization` (hvd_runtime.mfu), each rate also comes with its `mfu`.

    The same collective (every STOP_CHECK_EVERY steps without log points) says whether any rank
    has been asked to stop (hvd_runtime.preemption); if so, every rank ends after the next
    optimizer step: `on_stop()` (a checkpoint), then Preempted.
    """
    k = step.batches_per_update
    steps = batches.steps(state.samples_in_epoch)
    usable = steps - steps % k
    sums: dict[str, object] = {"loss": 0.0}
    seen = 0
    batch_iter = progress(batches.batches(state.epoch, state.samples_in_epoch), enabled=is_root,
                          desc=f"epoch {state.epoch}", total=usable)
    speed = Throughput(batches.samples_per_step, utilization=utilization)
    check_every = log_every or preemption.STOP_CHECK_EVERY
    stopping = None   # the signal every rank stops on, once one was asked
    for i, (x, y) in enumerate(batch_iter):
        if i >= usable:
            break
        apply = (i + 1) % k == 0
        # an epoch's first step follows evaluation, checkpoints and logging on other ranks: the allowance
        watchdog.beat(f"step {state.step + 1} (epoch {state.epoch})", allowance=i == 0)
        skipped = skipped_updates(step)
        loss, metric_sums = step.train_batch(x, y, apply, state.step)
        n = int(y.shape[0])
        if skipped_updates(step) == skipped:   # a skipped update's batch was not trained on: not counted
            sums["loss"] = sums["loss"] + loss * n
            for key, value in metric_sums.items():
                sums[key] = sums.get(key, 0.0) + value
            seen += n if step.reports_loss else 0
        state.step += 1
        state.samples_in_epoch += batches.samples_per_step
        speed.tokens_per_sample = int(np.prod(y.shape[1:]))  # a language model's targets: one per token
        speed.step()
        if state.step % check_every == 0:
            # Horovod: every rank calls, at the same step: the batch loss averaged over the job (a
            # stage's penalty terms add in, the ranks reporting the data loss count), and how many
            # ranks were asked to stop, by each stop signal
            totals = step.sum_over_ranks(np.array([float(loss), float(step.reports_loss), *preemption.asked()]),
                                         "loop.point")
            stopping = stopping or preemption.agreed(totals[2:])
            if log_every and on_log is not None:
                mean = float(totals[0] / totals[1]) if totals[1] else float("nan")
                point = {"step_train_loss": mean} | speed.since_last()
                if hasattr(batch_iter, "set_postfix_str"):
                    batch_iter.set_postfix_str(_rates(point), refresh=False)
                on_log(point, state.step)
        for hook in every:
            if apply and hook.steps and state.step % hook.steps == 0:
                hook.action()
        if stopping and apply:
            stop(state, stopping, is_root, on_stop)
    state.epoch += 1
    state.samples_in_epoch = 0
    # Horovod: sample-weighted over every rank's shard, not just this one.
    return means_over_ranks({f"train_{key}": value for key, value in sums.items()}, seen, step.sum_over_ranks,
                            "metrics.train") | {f"train_{key}": value for key, value in speed.epoch().items()}


def _rates(point: dict[str, float]) -> str:
    """The progress bar's rates: samples (a language model's tokens) per second, and the MFU."""
    rate = (f"{point['tokens_per_s']:.4g} tokens/s" if "tokens_per_s" in point
            else f"{point['samples_per_s']:.4g} samples/s")
    return rate + (f", mfu {point['mfu']:.1%}" if "mfu" in point else "")


def skipped_updates(step: Step) -> int:
    """How many non-finite updates the step's guard (hvd_runtime.nonfinite) has skipped; 0 without one."""
    guard = getattr(step, "guard", None)
    return guard.skipped if guard is not None else 0


def stop(state, signum: int, is_root: bool, on_stop: Callable[[], bool] | None) -> None:
    """End training after this step on `signum`, every rank alike: its checkpoint (`on_stop()`:
    whether it was written), then Preempted."""
    watchdog.beat(f"the checkpoint at step {state.step} before stopping", allowance=True)
    written = on_stop() if on_stop is not None else False
    stopped = preemption.Preempted(signum, state.step)
    if is_root:
        where = ("its checkpoint written: launch again to resume there" if written
                 else "its checkpoint not written: launch again to resume from the newest")
        print(f"stopped on {stopped.signal_name} after step {state.step} (epoch {state.epoch}), {where}", flush=True)
    raise stopped


def evaluate(step: Step, batches) -> dict[str, float]:
    """val_loss and val_<metric> over the whole validation set, each sample counted once on one rank."""
    watchdog.beat("evaluation", allowance=True)
    loss, metrics = step.evaluate(batches)
    return {"val_loss": loss, **{f"val_{key}": value for key, value in metrics.items()}}


def evaluate_batches(totals: Callable, batches: Iterable, sum_over_ranks: Callable,
                     metric_names: Sequence[str]) -> tuple[float, dict[str, float]]:
    """(mean loss, metric means) of `totals(x, y) -> (loss sum, {metric: sum})` over every rank's batches.

    Shards are uneven: totals and counts are summed over the job before dividing. A rank may have
    no batch at all, so the metrics are named up front: every rank sends the same vector.
    """
    sums: dict[str, object] = {"loss": 0.0, **{key: 0.0 for key in metric_names}}
    seen = 0
    for x, y in batches:
        loss_sum, metric_sums = totals(x, y)
        sums["loss"] = sums["loss"] + loss_sum
        for key, value in metric_sums.items():
            sums[key] = sums[key] + value
        seen += int(y.shape[0])
    means = means_over_ranks(sums, seen, sum_over_ranks, "metrics.eval")
    return means.pop("loss"), means
