"""Pipeline-parallel training over Horovod on TensorFlow: stages on ranks, micro-batches, dp replicas.

    from hvd_runtime.tf.pipeline import PipelineEngine, build_stage, init_pipeline

    ctx, place = init_pipeline(stages=2, seed=0)       # Horovod init with the pipeline's process sets
    stage = build_stage(model, place)                    # this rank's layers of the unchanged model
    engine = PipelineEngine(stage, place, loss_fn, keras.optimizers.SGD(0.1), schedule="1f1b", micro_batches=4)
    loss, metrics = engine.train_step(x, y)             # same numbers on every rank

Each micro-batch's forward runs under its own `tf.GradientTape`, kept until the schedule reaches
its backward: `tape.gradient(output, [input, *variables], output_gradients=grad_from_next_stage)`
gives the gradient to send back and this micro-batch's share of the variables' gradients, which
add up over the step. Then the stage's gradients are averaged over its dp replicas (a Horovod
process set) and applied. Data: shard by replica, as in hvd_runtime.torch.pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from hvd_runtime.pipeline.partition import Partition, PartitionError
from hvd_runtime.pipeline.engine import PipelineEngineBase
from hvd_runtime.config import ConfigError
from hvd_runtime.nonfinite import Guard
from hvd_runtime.parallel.dims import ParallelDims
from hvd_runtime.pipeline.grid import PipelineConfigError, PipelineRank, chunks_per_rank
from hvd_runtime.pipeline.schedule import SPLIT_BACKWARD, SPLIT_BACKWARD_TORCH_ONLY
from hvd_runtime.tf.compiled import compiled, compiled_for_any_batch
from hvd_runtime.tf.context import Context
from hvd_runtime.tf.grid import init_pipeline
from hvd_runtime.tf.meta_init import is_meta
from hvd_runtime.tf.names import is_state
from hvd_runtime.tf.precision import poisoned
from hvd_runtime.tf.stage import Stage, plan_stages, plan_timed_on_rank0, rank_stage
from hvd_runtime.tf.tensor_parallel import slice_layers
from hvd_runtime.tf.tensor_state import SlicedVariables

__all__ = ["ParallelDims", "PipelineConfigError", "PipelineEngine", "PipelineRank", "ReplicaContext", "build_stage",
           "chunks_per_rank", "init_pipeline", "replica_context", "slice_stage"]


@dataclass(frozen=True)
class ReplicaContext:
    """This rank seen as one of the dp replicas: what LR scaling counts (make_optimizer takes it as a Context)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: str

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        return self.rank

    @property
    def data_size(self) -> int:
        return self.size


def replica_context(ctx: Context, place: PipelineRank) -> ReplicaContext:
    """The data-parallel view of this rank: its replica among `replicas` (stages do not multiply the batch)."""
    ranks = place.stages * place.dims.tp  # the ranks of one replica: its stages, each split over tp
    return ReplicaContext(place.replica, place.replicas, ctx.local_rank // ranks, max(1, ctx.local_size // ranks),
                          ctx.device)


def build_stage(model, place: PipelineRank, partition: Partition | str | list = "params", sample=None,
                tail=None) -> Stage:
    """This rank's stage of `model`, cut the same way on every rank (a timed plan comes from rank 0);
    with chunks (interleaved schedules) its pieces stage, stage + p, ... of p x chunks.
    partition="time" times the layers on `sample`, and `tail` (time_costs') with the last."""
    pieces = place.stages * place.chunks
    if partition == "time":
        plan = plan_timed_on_rank0(model, pieces, sample, tail, "pp.partition")
    else:
        plan = plan_stages(model, pieces, partition, sample, tail)
    if plan.stages != pieces:
        of = f"{place.stages} x {place.chunks} chunks" if place.chunks > 1 else f"{place.stages}"
        raise PartitionError(f"partition has {plan.stages} stages but the pipeline has {of}")
    return rank_stage(model, place.stage, plan, place.stages)


def slice_stage(stage: Stage, place: PipelineRank) -> Stage:
    """The stage with its transformer blocks, token embedding and head split over its tensor-parallel
    group (init_pipeline's tp; the last stage's logits are then split over the vocabulary).

    A stage without values (hvd_runtime.tf.meta_init) splits into meta slices, which every rank
    draws from the same recipes: one model for the group without a message. A built stage was
    built under each rank's own seed: every rank of the group first takes its first rank's
    variables, so that the slices come from one model and the variables kept whole (LayerNorm,
    position embeddings) are the same on all. Unchanged at tp 1. The split stage keeps the stage's
    layers in order.
    """
    import horovod.tensorflow as hvd

    group = place.tensor_group
    if group is None:
        return stage
    if not is_meta(stage):
        root = place.dims.tp_ranks(place.rank)[0]
        # Horovod: one model for the whole group, from its first rank
        hvd.broadcast_variables([v.value for v in stage.variables if is_state(v)], root_rank=root,
                                process_set=group.process_set)
    return stage.with_layers(slice_layers(stage.layers, group))


def stage_state_variables(stage: Stage, optimizer) -> list:
    """What replicas of one stage must hold identically: float stage variables and the optimizer's."""
    return [v for v in stage.variables if "float" in str(v.dtype)] + list(optimizer.variables)


def _compiled_chunk(stage: Stage, chunk: int, training: bool, loss_fn=None, metrics_fn=None,
                    metric_names: list | None = None):
    """The stage's chunk `chunk` as one compiled call of its input, in training mode or not.

    With loss_fn (the model's last chunk), a call of (input, targets) returning (output, loss,
    sums): the loss, and the micro-batch's sums for the step's report ([loss x n, n, metric x n
    ...], float64, metrics_fn's metrics in the order of their names, which the trace writes into
    `metric_names`), all in the same call, not as Keras' few dozen small ops, a call of the
    metrics and the sums' products dispatched one by one: 1.2 -> 0.9 ms a micro-batch's forward
    on the last stage of the generated digits-MLP pipeline.
    """
    if loss_fn is None:
        return compiled_for_any_batch(lambda x: stage.call_chunk(chunk, x, training=training))

    def output_loss_and_sums(x, y):
        out = stage.call_chunk(chunk, x, training=training)
        loss = loss_fn(y, out)
        metrics = metrics_fn(out, y) if metrics_fn is not None else {}
        metric_names[:] = sorted(metrics)
        n = tf.cast(tf.shape(y)[0], tf.float64)
        sums = tf.stack([tf.cast(loss, tf.float64) * n, n,
                         *(tf.cast(metrics[name], tf.float64) * n for name in metric_names)])
        return out, loss, sums
    return compiled_for_any_batch(output_loss_and_sums)


def _added(sums: list, grads: list) -> list:
    """sums + grads, element by element; a None gradient (a variable the micro-batch did not reach) adds nothing.

    Dense: an embedding's IndexedSlices neither add up over micro-batches nor give a true norm (a
    token's row counts once per occurrence).
    """
    return [total if g is None else total + tf.convert_to_tensor(g) for total, g in zip(sums, grads)]


class PipelineEngine(PipelineEngineBase):
    """Runs one stage's part of the schedule each step, then averages its gradients over dp."""

    def __init__(self, stage: Stage, place: PipelineRank, loss_fn, optimizer, schedule: str = "1f1b",
                 micro_batches: int = 4, metrics_fn=None, timeline: bool = False, timeline_steps: int = 20,
                 clip_norm: float = 0.0, guard: Guard | None = None):
        import horovod.tensorflow as hvd

        if schedule in SPLIT_BACKWARD:
            raise ConfigError(f"parallel.schedule {schedule} {SPLIT_BACKWARD_TORCH_ONLY}: use 1f1b")
        super().__init__(hvd, place, schedule, micro_batches, metrics_fn, timeline, timeline_steps, guard)
        self.stage, self.loss_fn, self.optimizer, self.clip_norm = stage, loss_fn, optimizer, clip_norm
        self.variables = list(stage.trainable_variables)
        # Tensor-parallel stages: the variables held as slices (the clip norm counts them apart)
        split = set(SlicedVariables(stage).by_id) if place.dims.tp > 1 else set()
        self._whole_share = [1.0 if id(v) in split else 1.0 / place.dims.tp for v in self.variables]
        if not optimizer.built:
            optimizer.build(self.variables)
        self._saved: dict[tuple, tuple] = {}  # (chunk, micro-batch) -> (tape, input, [output or loss, penalty?])
        self._grads: list = []
        # each chunk's trainable variables, and where they sit in self.variables (whose gradients add up)
        at = {id(v): k for k, v in enumerate(self.variables)}
        self._chunk_variables = [[v for layer in stage.chunk_layers(c) for v in layer.trainable_variables]
                                 for c in range(self.chunks)]
        self._chunk_slots = [[at[id(v)] for v in chunk] for chunk in self._chunk_variables]
        # compiled once per chunk and mode, for every micro-batch size; a tape around the call
        # still records it, and its gradient is compiled too
        self._traced_metric_names: list[str] = []
        self._chunk_fns = [{training: _compiled_chunk(stage, c, training, loss_fn, metrics_fn, self._traced_metric_names)
                                      if self._is_last(c) else _compiled_chunk(stage, c, training)
                            for training in (True, False)} for c in range(self.chunks)]
        self._micro_batch_sums = None   # the last chunk's forward: its sums, for _stats
        # the rest of a step compiled too: run eagerly, each is a few small ops per variable (AdamW's
        # update about 15), dispatched one by one from Python (docs/pipeline.md measures it)
        self._zeros = compiled(lambda: [tf.zeros(v.shape, v.dtype) for v in self.variables])
        self._add = compiled(_added, reduce_retracing=True)   # an embedding's IndexedSlices vary in length
        self._update = compiled(self._update_fn)
        self._squared_norm = compiled(self._squared_norm_fn)
        self._sync_replicas()

    def _sync_replicas(self) -> None:
        """Start every replica of this stage from replica 0's variables and optimizer state."""
        if self.place.dp_set is None:
            return
        root = self.place.stage_root
        self.hvd.broadcast_variables([v.value for v in stage_state_variables(self.stage, self.optimizer)],
                                     root_rank=root, process_set=self.place.dp_set)

    # -- the framework hooks of PipelineEngineBase ---------------------------------------------------
    def _forward(self, c, i, inp, y, weight, train):
        last, chunk = self._is_last(c), self._chunk_fns[c][train]
        if not train:
            return self._call_chunk(chunk, inp, y, last)
        with tf.GradientTape() as tape:
            tape.watch(inp)
            out, loss = self._call_chunk(chunk, inp, y, last)
            # the chunk's regularisation terms, as Keras adds them to the loss: each micro-batch
            # carries its share (weight), so a step adds them once, whichever stage holds the layers
            terms = [term for layer in self.stage.chunk_layers(c) for term in layer.losses]
            penalty = [tf.add_n(terms) * weight] if terms else []
            differentiated = poisoned(loss) if last and self.checks else loss   # NaN gradients for a non-finite loss
            target = [differentiated * weight if last else out, *penalty]   # on the tape: what the backward differentiates
        if penalty:   # in float64, as the sums it is added to in train_batch
            self.penalty = self.penalty + tf.cast(tf.stop_gradient(penalty[0]), tf.float64)
        self._saved[(c, i)] = (tape, inp, target)
        return out, loss

    def _call_chunk(self, chunk, inp, y, last: bool):
        """(output, loss or None); the last chunk's sums wait in _micro_batch_sums for _stats."""
        if not last:
            return chunk(inp), None
        out, loss, self._micro_batch_sums = chunk(inp, y)
        return out, loss

    def _stats(self, loss, out, y, n):
        """The sums the forward computed with the loss, in the same compiled call."""
        if self.metrics_fn is not None and self._metric_names is None:
            self._metric_names = list(self._traced_metric_names)
        return self._micro_batch_sums

    @staticmethod
    def _add_stats(sums, more):
        return sums + more   # one float64 vector each

    def _backward(self, c, i, grad):
        tape, inp, target = self._saved.pop((c, i))
        first, variables = self._is_first(c), self._chunk_variables[c]
        sources = variables if first else [inp, *variables]
        # the output's gradient from the next stage (none at the model's end), and 1 for a penalty
        seeds = [grad if grad is not None else tf.ones_like(target[0])] + [tf.ones_like(t) for t in target[1:]]
        grads = tape.gradient(target, sources, output_gradients=seeds)
        slots = self._chunk_slots[c]
        sums = self._add([self._grads[slot] for slot in slots], list(grads if first else grads[1:]))
        for slot, total in zip(slots, sums):
            self._grads[slot] = total
        if first:
            return None
        return grads[0] if grads[0] is not None else tf.zeros_like(inp)

    def _micro_batches(self, t, sizes):
        return tf.split(t, sizes, axis=0)

    def _begin_step(self):
        self._grads = self._zeros() if self.variables else []   # each micro-batch's gradients add to these

    def _finish_step(self):
        grads, self._grads = self._grads, []
        if self.variables and self.place.dp_set is not None:
            # Horovod: average this stage's gradients over its dp replicas only
            grads = self.hvd.grouped_allreduce(grads, op=self.hvd.Average, name="pp.grads",
                                               process_set=self.place.dp_set)
        scale = 1.0
        if self.clip_norm or self.checks:
            # a weight-free stage (a lone flatten) adds its share, none, to the job-wide norm too
            norm = self._grad_norm(grads)
            if self.checks and not self.guard.allows(math.isfinite(norm), self.step_number):
                return
            if self.clip_norm and norm > self.clip_norm:
                scale = self.clip_norm / norm
        if self.variables:
            self._update(grads, tf.constant(scale, tf.float32))

    def _update_fn(self, grads: list, scale: tf.Tensor) -> None:
        self.optimizer.apply_gradients(zip([g * tf.cast(scale, g.dtype) for g in grads], self.variables))

    def _grad_norm(self, grads: list) -> float:
        """The whole model's gradient norm, not the stage's: squared norms summed over all ranks
        (every replica holds the same averaged gradients, so the sum is divided by the replicas),
        what Keras' global_clipnorm computes on the whole model. The same on every rank."""
        squares = self._squared_norm(grads) if grads else tf.zeros((), tf.float64)
        # Horovod: every rank's share of the squared norm, summed over the whole job
        return (float(self.hvd.allreduce(squares, op=self.hvd.Sum, name="pp.grad_norm")) / self.place.replicas) ** 0.5

    def _squared_norm_fn(self, grads: list) -> tf.Tensor:
        # With tensor parallelism a whole (unsplit) variable is held by each of the tp ranks of its
        # stage: its square counts 1/tp from each, a split one's slice counts once.
        return tf.add_n([tf.zeros((), tf.float64), *(share * tf.reduce_sum(tf.square(tf.cast(g, tf.float64)))
                                                     for g, share in zip(grads, self._whole_share))])

    def sum_over_ranks(self, values, name):
        return self.hvd.allreduce(tf.constant(values, tf.float64), op=self.hvd.Sum, name=name).numpy()

    @staticmethod
    def _count(t) -> int:
        return int(np.shape(t)[0])
