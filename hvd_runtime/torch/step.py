"""One training step of a whole model on each rank (data parallel, model-split, tensor parallel).

What hvd_runtime.loop drives (its Step): forward under the precision's autocast, backward, and on
every k-th batch the learning rate for this optimizer step, then the optimizer step that waits
for Horovod's allreduced gradients. Where the gradients are averaged (globally, over the dp set
of a tensor-parallel job) is the optimizer's business: make_optimizer wraps it accordingly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hvd_runtime.loop import evaluate_batches
from hvd_runtime.nonfinite import Guard
from hvd_runtime.torch.buffers import average_buffers
from hvd_runtime.torch.context import Context
from hvd_runtime.torch.objective import accuracy_sum
from hvd_runtime.torch.optim import WarmupSchedule
from hvd_runtime.torch.precision import Precision
from hvd_runtime.torch.zero import in_lockstep


def sum_over_ranks(values: np.ndarray, name: str) -> np.ndarray:
    """A float64 vector summed over every rank of the job."""
    import horovod.torch as hvd

    return hvd.allreduce(torch.from_numpy(values), op=hvd.Sum, name=name).numpy()


def stepped(optimizer) -> list[torch.Tensor]:
    """The tensors `optimizer` steps: the model's parameters, or under ZeRO this rank's rows of them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class TrainStep:
    """`train_batch(x, y, apply, step)` trains on one batch; returns its mean loss and number correct.

    With backward_passes_per_step = k > 1 gradients of k batches accumulate locally (Horovod's
    DistributedOptimizer counts them) before the k-th batch's one allreduce and update.
    `precision` (default fp32) runs the forward pass under autocast and, with fp16, clipping or
    a `guard` (hvd_runtime.nonfinite), steps as hvd_runtime.torch.precision explains.
    `accuracy_fn(output, target)`: the number right (a vocabulary-split model's comes from
    hvd_runtime.torch.vocab_parallel, as its loss_fn does).
    """

    metric_names = ("accuracy",)
    reports_loss = True   # every rank's batch is part of the job's loss

    def __init__(self, model: nn.Module, optimizer, schedule: WarmupSchedule, loss_fn, ctx: Context,
                 backward_passes_per_step: int = 1, precision: Precision | None = None, accuracy_fn=accuracy_sum,
                 guard: Guard | None = None):
        self.model, self.optimizer, self.schedule, self.loss_fn, self.ctx = model, optimizer, schedule, loss_fn, ctx
        self.guard = guard
        self.accuracy_fn = accuracy_fn
        self.batches_per_update = backward_passes_per_step
        self.precision = precision or Precision("fp32", ctx.device)
        self.sum_over_ranks = sum_over_ranks

    def train_batch(self, x, y, apply: bool, step: int):
        k = self.batches_per_update
        if step % k == 0:  # a new optimizer step: also after evaluation, a resume or an elastic reset
            self.model.train()
            self.optimizer.zero_grad()
        with self.precision.autocast():
            out = self.model(x)
            y = y.to(out.device, non_blocking=True)  # a split model answers on its last stage's device
            loss = self.loss_fn(out, y)
        self.precision.backward(loss / k, self.guard)
        if apply:
            self.schedule.apply(self.optimizer, step // k, self.ctx.data_size, self.ctx.local_size)
            # Horovod: waits for the allreduced gradients, then applies them if they are finite.
            self.precision.step(self.optimizer, stepped(self.optimizer), self.guard, step + 1)
            self.optimizer.zero_grad()
        # Totals stay tensors on the output's device: no host sync per step.
        return loss.detach().float(), {"accuracy": self.accuracy_fn(out.detach(), y)}

    @torch.no_grad()
    def evaluate(self, batches) -> tuple[float, dict[str, float]]:
        """Loss and accuracy over the whole validation set, each sample counted once on one rank.

        Every rank first takes the job's mean BatchNorm statistics, so all ranks evaluate one model.
        """
        average_buffers(self.model, name="eval.buffers")
        self.model.eval()

        def totals(x, y):
            with self.precision.autocast():
                out = self.model(x)
            y = y.to(out.device, non_blocking=True)
            return self.loss_fn(out, y).float() * len(y), {"accuracy": self.accuracy_fn(out, y)}

        if getattr(self.optimizer, "stage", 0) == 3:   # ZeRO 3: each forward gathers over every replica
            batches = in_lockstep(batches, lambda x: self.model(x.to(self.ctx.device)))

        return evaluate_batches(totals, batches, self.sum_over_ranks, self.metric_names)
