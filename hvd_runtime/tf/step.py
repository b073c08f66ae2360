"""One training step in a custom loop: forward, backward, allreduce, apply; compiled once.

What hvd_runtime.loop drives (its Step), for a whole model on each rank (data parallel,
model-split, tensor parallel).

This is the loop Keras 3 needs under Horovod: `horovod.tensorflow.keras`'s DistributedOptimizer
is never called by Keras 3's `model.fit`, which then trains each rank alone without a word.
Here the allreduce is an explicit line between `tape.gradient` and `apply_gradients`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvd_runtime.loop import evaluate_batches
from hvd_runtime.nonfinite import Guard
from hvd_runtime.tf.buffers import average_statistics
from hvd_runtime.tf.compiled import compiled, compiled_for_any_batch
from hvd_runtime.tf.gradients import GradientAccumulator, GradientSync
from hvd_runtime.tf.objective import accuracy_sum
from hvd_runtime.tf.precision import is_loss_scaled, poisoned


def sum_over_ranks(values: np.ndarray, name: str) -> np.ndarray:
    """A float64 vector summed over every rank of the job."""
    import horovod.tensorflow as hvd

    return hvd.allreduce(tf.constant(values), op=hvd.Sum, name=name).numpy()


class TrainStep:
    """`step(x, y, apply)` trains on one batch; returns its mean loss and number correct.

    With backward_passes_per_step = k > 1 the batch's gradients are accumulated, and only calls
    with `apply=True` (every k-th) allreduce the mean and update the weights.

    clip_norm with grad_norm(grads, variables): clip by a norm the optimizer cannot see alone (a
    tensor-parallel model's, summed over its group), after the allreduce; the optimizer must then
    not clip itself (make_optimizer(clip=False)). `accuracy_fn(logits, y)`: the number right (a
    vocabulary-split model's comes from hvd_runtime.tf.vocab_parallel, as its loss_fn does).
    """

    metric_names = ("accuracy",)
    reports_loss = True   # every rank's batch is part of the job's loss

    def __init__(self, model, optimizer, loss_fn, sync: GradientSync, backward_passes_per_step: int = 1,
                 clip_norm: float = 0.0, grad_norm=None, accuracy_fn=accuracy_sum, guard: Guard | None = None):
        self.model, self.optimizer, self.loss_fn, self.sync = model, optimizer, loss_fn, sync
        # fp16: the loss-scale optimizer skips an overflowed update itself (hvd_runtime.nonfinite)
        self.guard = guard if guard is not None and guard.checks and not is_loss_scaled(optimizer) else None
        self.accuracy_fn = accuracy_fn
        self.clip_norm, self.grad_norm = clip_norm if grad_norm is not None else 0.0, grad_norm
        self.variables = list(model.trainable_variables)
        # what the optimizer steps: the variables, or under ZeRO (hvd_runtime.tf.zero) this rank's rows
        self.stepped = sync.applies_to(self.variables)
        self.batches_per_update = backward_passes_per_step
        self.sum_over_ranks = sum_over_ranks
        k = backward_passes_per_step
        # ZeRO 2 reduce-scatters each pass: only this rank's rows are summed
        self.accumulator = GradientAccumulator(self.stepped if sync.scatters_each_pass else self.variables, k) \
            if k > 1 else None
        # traced once for every batch size; batches too small for the model's cut into micro-batches
        # (ModelSplit's) once per size
        at_least = getattr(model, "min_batch_for_any_size", 1)
        self._step = compiled_for_any_batch(self._train_on_batch, at_least)
        self._accumulate = compiled_for_any_batch(self._accumulate_batch, at_least)
        self._apply_accumulated = compiled(self._apply_accumulated_fn)
        self._eval_totals = compiled_for_any_batch(self._eval_totals_fn, at_least)

    def _forward_backward(self, x, y):
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            loss = self.loss_fn(y, logits)
            if self.model.losses:  # kernel regularizers and add_loss() terms, as model.fit adds them
                loss = loss + tf.add_n(self.model.losses)
            # fp16: differentiate the scaled loss; apply_gradients unscales (a no-op otherwise). Under
            # a guard a non-finite loss makes every gradient NaN.
            scaled = self.optimizer.scale_loss(poisoned(loss) if self.guard is not None else loss)
        grads = tape.gradient(scaled, self.variables)
        return loss, self.accuracy_fn(logits, y), grads

    def _apply(self, grads, synced: bool = False):
        """Whether the update was applied (a boolean tensor): under a guard, only finite gradients are.
        `synced`: the gradients are averaged already (ZeRO 2's accumulated rows)."""
        # Horovod: average gradients across ranks (one grouped allreduce; ZeRO: a reduce-scatter
        # into this rank's rows), then update. The optimizer clips by global norm (optim.clip_norm)
        # and, for fp16, unscales and skips overflowed steps: both on the averaged gradients, so
        # every rank does the same.
        if not synced:
            grads = self.sync(grads, self.variables)
        if self.guard is None:
            if self.clip_norm:
                grads = self._clipped(grads)
            self._update(grads)
            return tf.constant(True)
        # the averaged gradients' norm is the same on every rank of the set: every rank decides alike
        norm = self.grad_norm(grads, self.stepped) if self.grad_norm is not None else tf.linalg.global_norm(
            [g for g in grads if g is not None])
        finite = tf.math.is_finite(norm)

        def update():
            self._update(self._clipped(grads, norm) if self.clip_norm else grads)
            return tf.constant(True)
        return tf.cond(finite, update, lambda: tf.constant(False))

    def _update(self, grads) -> None:
        self.optimizer.apply_gradients(zip(grads, self.stepped))
        self.sync.applied()   # ZeRO: every rank's updated rows all-gathered into the model

    def _clipped(self, grads, norm=None):
        """grads scaled to at most clip_norm (of the unscaled gradients, under fp16 loss scaling)."""
        norm = self.grad_norm(grads, self.stepped) if norm is None else norm
        scale = getattr(self.optimizer, "dynamic_scale", None)  # fp16: the grads are the scaled loss's
        unscaled = norm / tf.cast(scale, norm.dtype) if scale is not None else norm
        factor = self.clip_norm / tf.maximum(unscaled, self.clip_norm)   # as Keras's global_clipnorm scales
        return [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]

    def _train_on_batch(self, x, y):
        loss, correct, grads = self._forward_backward(x, y)
        return loss, correct, self._apply(grads)

    def _accumulate_batch(self, x, y):
        loss, correct, grads = self._forward_backward(x, y)
        self.accumulator.add(self.sync(grads, self.variables) if self.sync.scatters_each_pass else grads)
        return loss, correct

    def _apply_accumulated_fn(self):
        return self._apply(self.accumulator.mean_and_reset(), synced=self.sync.scatters_each_pass)

    def __call__(self, x, y, apply: bool = True):
        """(loss, number correct, whether the update was applied: True where there was none)."""
        if self.accumulator is None:
            return self._step(x, y)
        loss, correct = self._accumulate(x, y)
        return loss, correct, self._apply_accumulated() if apply else tf.constant(True)

    def train_batch(self, x, y, apply: bool, step: int):
        """hvd_runtime.loop's call: the learning rate follows the optimizer's own iterations."""
        loss, correct, applied = self(x, y, apply=apply)
        if self.guard is not None and apply:
            # the update is already skipped in the graph: this counts it, and stops the run if due
            self.guard.allows(bool(applied), step + 1)
        return loss, {"accuracy": correct}

    def _eval_totals_fn(self, x, y):
        logits = self.model(x, training=False)
        return self.loss_fn(y, logits) * tf.cast(tf.shape(y)[0], tf.float32), {"accuracy": self.accuracy_fn(logits, y)}

    def evaluate(self, batches) -> tuple[float, dict[str, float]]:
        """Loss and accuracy over the whole validation set, each sample counted once on one rank.

        Every rank first takes the job's mean BatchNorm statistics, so all ranks evaluate one model.
        """
        average_statistics(self.model, name="eval.statistics")
        return evaluate_batches(self._eval_totals, batches, self.sum_over_ranks, self.metric_names)
