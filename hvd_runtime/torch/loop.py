"""One epoch of training and one pass of evaluation, with metrics averaged over all ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from hvd_runtime.progress import progress
from hvd_runtime.throughput import Throughput
from hvd_runtime.torch.batches import ShardedBatches
from hvd_runtime.torch.buffers import average_buffers
from hvd_runtime.torch.context import Context
from hvd_runtime.torch.objective import accuracy_sum
from hvd_runtime.torch.optim import WarmupSchedule
from hvd_runtime.torch.precision import Precision


@dataclass(frozen=True)
class Every:
    """Run `action()` after every `steps` training steps (0 = never), on every rank at once."""

    steps: int
    action: Callable[[], object]


def allreduce_sums(sums: dict[str, torch.Tensor], count: torch.Tensor) -> dict[str, float]:
    """Global means: sum every rank's totals and counts in one allreduce, then divide.

    Averaging per-rank means would weight a rank's last, shorter shard like a full one.
    """
    import horovod.torch as hvd

    stacked = torch.stack([*(v.double().cpu() for v in sums.values()), count.double().cpu()])
    totals = hvd.allreduce(stacked, op=hvd.Sum, name="metric_sums")
    if totals[-1] == 0:  # an epoch resumed at its very end trained nothing
        return {name: float("nan") for name in sums}
    return {name: (totals[i] / totals[-1]).item() for i, name in enumerate(sums)}


def train_epoch(model: nn.Module, batches: ShardedBatches, optimizer, schedule: WarmupSchedule, loss_fn,
                ctx: Context, state, backward_passes_per_step: int = 1, log_every: int = 0,
                on_log: Callable[[dict[str, float], int], None] | None = None,
                every: Sequence[Every] = (), precision: Precision | None = None) -> dict[str, float]:
    """Train the rest of epoch `state.epoch`; return loss and accuracy averaged over ranks, and speed.

    `state` (a TrainState or Horovod's elastic state) advances as it goes: `step`, and
    `samples_in_epoch`, from which a resumed or resized job continues; at the end of the epoch
    `epoch` moves on and `samples_in_epoch` returns to 0. With backward_passes_per_step = k,
    gradients of k batches accumulate locally before one allreduce; the epoch is trimmed to a
    multiple of k so no half-accumulated step is left over. Every `log_every` steps, the batch
    loss averaged over ranks and the throughput since the last point go to `on_log(metrics, step)`.
    `precision` (default fp32) runs the forward pass under autocast and, with fp16 or clipping,
    steps as hvd_runtime.torch.precision explains.
    """
    model.train()
    precision = precision or Precision("fp32", ctx.device)
    k = backward_passes_per_step
    steps = batches.steps(state.samples_in_epoch)
    usable = steps - steps % k
    # Totals stay tensors on the output's device: no host sync per step.
    loss_sum, correct, seen = torch.zeros(()), torch.zeros(()), 0
    optimizer.zero_grad()
    batch_iter = progress(batches.batches(state.epoch, state.samples_in_epoch), enabled=ctx.is_root,
                          desc=f"epoch {state.epoch}", total=usable)
    speed = Throughput(batches.samples_per_step)
    for i, (x, y) in enumerate(batch_iter):
        if i >= usable:
            break
        with precision.autocast():
            out = model(x)
            y = y.to(out.device, non_blocking=True)  # a split model answers on its last stage's device
            loss = loss_fn(out, y)
        precision.backward(loss / k)
        if (i + 1) % k == 0:
            schedule.apply(optimizer, state.step // k, ctx.data_size, ctx.local_size)
            # Horovod: waits for the allreduced gradients, then applies them.
            precision.step(optimizer, model.parameters())
            optimizer.zero_grad()
        loss_sum = loss_sum.to(out.device) + loss.detach().float() * len(y)
        correct = correct.to(out.device) + accuracy_sum(out.detach(), y)
        seen += len(y)
        state.step += 1
        state.samples_in_epoch += batches.samples_per_step
        speed.tokens_per_sample = y[0].numel()  # a language model's targets: one per token
        speed.step()
        if log_every and on_log and state.step % log_every == 0:
            point = allreduce_sums({"step_train_loss": loss.detach()}, torch.ones(())) | speed.since_last()
            if hasattr(batch_iter, "set_postfix_str"):
                batch_iter.set_postfix_str(f"{point['samples_per_s']:.0f} samples/s", refresh=False)
            on_log(point, state.step)
        for hook in every:
            if hook.steps and state.step % hook.steps == 0 and (i + 1) % k == 0:
                hook.action()
    state.epoch += 1
    state.samples_in_epoch = 0
    # Horovod: average over all ranks, not just this one.
    return allreduce_sums({"train_loss": loss_sum, "train_accuracy": correct}, torch.tensor(seen)) | {
        f"train_{name}": value for name, value in speed.epoch().items()}


@torch.no_grad()
def evaluate(model: nn.Module, batches: ShardedBatches, loss_fn, ctx: Context,
             precision: Precision | None = None) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, each sample counted once on one rank.

    Every rank first takes the job's mean BatchNorm statistics, so all ranks evaluate one model.
    """
    average_buffers(model, name="eval.buffers")
    model.eval()
    precision = precision or Precision("fp32", ctx.device)
    loss_sum, correct, seen = torch.zeros(()), torch.zeros(()), 0
    for x, y in batches:
        with precision.autocast():
            out = model(x)
        y = y.to(out.device, non_blocking=True)
        loss_sum = loss_sum.to(out.device) + loss_fn(out, y).float() * len(y)
        correct = correct.to(out.device) + accuracy_sum(out, y)
        seen += len(y)
    # Horovod: shards are uneven, so sum totals and counts over ranks before dividing.
    return allreduce_sums({"val_loss": loss_sum, "val_accuracy": correct}, torch.tensor(seen))
