"""Stages cut from an unchanged Keras model: runs of its own layers, shared, not copied.

The user's model is a `keras.Sequential` (or a list of layers), each layer passing one tensor to
the next. A stage is the layers of `[start, stop)`; it owns nothing, so its variables are the
model's own objects, and training a stage trains the model. Blocks are named by layer name, and
stage starts may be given by name or by index (`model.layers` order, Input excluded).

    plan = plan_stages(model, stages=2, by="params")          # or by="time", sample=x
    stage = build_stage(model, 1, plan)                       # layers of stage 1
    y = stage(x, training=True); stage.trainable_variables

With chunks (interleaved schedules), the model is cut into p x v pieces and a rank's stage holds
pieces r, r + p, ... (`rank_stage`), run a chunk at a time by `call_chunk`.
"""

from __future__ import annotations

import time
from typing import Sequence

import tensorflow as tf

from hvd_runtime.tf.meta_init import is_meta, made_real
from hvd_runtime.pipeline.partition import (Partition, PartitionError, plan_on_rank0, plan_partition,
                                            refuse_weights_shared_across_stages)


def named_blocks(model) -> list[tuple[str, object]]:
    """(name, layer) in order, from a keras.Sequential or a list of layers."""
    import keras

    if isinstance(model, keras.Sequential):
        return [(layer.name, layer) for layer in model.layers]
    if isinstance(model, (list, tuple)) and all(isinstance(b, keras.layers.Layer) for b in model):
        return [(layer.name, layer) for layer in model]
    raise PartitionError(f"cannot split a {type(model).__name__}: give a keras.Sequential or a list of layers "
                         f"(e.g. keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(2)]))")


def param_costs(model) -> list[int]:
    """Parameters per block: balances memory, costs nothing to compute."""
    return [int(layer.count_params()) if layer.built else 0 for _, layer in named_blocks(model)]


def time_costs(model, sample, repeats: int = 3, tail=None) -> list[float]:
    """Seconds of forward + backward per block on `sample`, the fastest of `repeats` runs.

    `tail(output) -> loss` is what the last stage does beyond its layers (the loss and the
    metrics): its forward and backward count to the last layer, which always runs there.
    """
    costs, x = [], tf.convert_to_tensor(sample)
    layers = named_blocks(model)
    kept = [(v, v.numpy()) for _, layer in layers for v in layer.non_trainable_variables  # BatchNorm's statistics
            if not is_meta(v)]
    for _, layer in layers:
        with made_real(layer):   # a layer without values (meta_init) has them while it is timed, then not
            costs.append(_fastest_gradient(lambda inp: tf.reduce_sum(tf.cast(layer(inp, training=True), tf.float32)),
                                           x, layer.trainable_variables, repeats))
            x = layer(x, training=False)
    if tail is not None:
        costs[-1] += _fastest_gradient(tail, x, [], repeats)
    for variable, before in kept:   # timing trains nothing: the statistics it moved go back
        variable.assign(before)
    return costs


def _fastest_gradient(fn, x, variables, repeats: int) -> float:
    """The fastest of `repeats` runs of fn(x) -> a scalar and its gradient for x and `variables`
    (a layer and its weights, or the tail)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = fn(x)
        tape.gradient(value, [x, *variables])
        best = min(best, time.perf_counter() - start)
    return best


def plan_stages(model, stages: int, by: str | Sequence = "params", sample=None, tail=None) -> Partition:
    """Partition the model's layers: by="params", by="time" (needs sample; `tail` as time_costs'),
    or stage starts."""
    names = [n for n, _ in named_blocks(model)]
    timing = (lambda: time_costs(model, sample, tail=tail)) if sample is not None else None
    plan = plan_partition(names, stages, by, lambda: param_costs(model), timing)
    refuse_weights_shared_across_stages(plan, [(name, layer.variables) for name, layer in named_blocks(model)])
    return plan


def plan_timed_on_rank0(model, stages: int, sample, tail, name: str) -> Partition:
    """plan_stages(by="time") for a job: rank 0 times the blocks, every rank cuts where it does
    (pipeline.partition.plan_on_rank0). `name` names the broadcast."""
    import horovod.tensorflow as hvd

    return plan_on_rank0(lambda: plan_stages(model, stages, "time", sample, tail), hvd.rank(),
                         lambda planned: hvd.broadcast_object(planned, root_rank=0, name=name))


class Stage:
    """Layers [start, stop) of a model, called in order; the variables are the model's.

    With chunks, the layers of each of the rank's pieces in turn; `chunks` (kept as chunk_sizes)
    says how many layers each piece has. `positions`: each layer's index in the whole model's
    layers, by which checkpoints name its variables (hvd_runtime.tf.checkpoint).
    """

    def __init__(self, layers: Sequence, index: int, plan: Partition, chunks: Sequence[int] | None = None,
                 positions: Sequence[int] | None = None):
        self.layers, self.index, self.plan = list(layers), index, plan
        self.chunk_sizes = list(chunks) if chunks else [len(self.layers)]
        self.positions = list(positions) if positions is not None else list(range(len(self.layers)))

    def with_layers(self, layers: Sequence) -> "Stage":
        """The same stage (index, cut, chunks, positions) of other layers in their places: its split."""
        return Stage(layers, self.index, self.plan, self.chunk_sizes, self.positions)

    def __call__(self, x, training: bool = False):
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def chunk_layers(self, chunk: int) -> list:
        start = sum(self.chunk_sizes[:chunk])
        return self.layers[start:start + self.chunk_sizes[chunk]]

    def call_chunk(self, chunk: int, x, training: bool = False):
        """Run one of the stage's chunks (the whole stage when it has one)."""
        for layer in self.chunk_layers(chunk):
            x = layer(x, training=training)
        return x

    @property
    def variables(self) -> list:
        return [v for layer in self.layers for v in layer.variables]

    @property
    def trainable_variables(self) -> list:
        return [v for layer in self.layers for v in layer.trainable_variables]

    @property
    def losses(self) -> list:
        """Regularisation terms of this stage's layers, as Keras adds them to the loss."""
        return [loss for layer in self.layers for loss in layer.losses]


def rank_stage(model, index: int, plan: Partition, stages: int) -> Stage:
    """The stage of rank `index` of a `stages`-rank pipeline over `plan`'s pieces: pieces index,
    index + stages, ... (one piece, build_stage's, when the plan has as many pieces as stages)."""
    if plan.stages % stages:
        raise PartitionError(f"partition has {plan.stages} stages, not a multiple of the pipeline's {stages}")
    pieces = [build_stage(model, piece, plan) for piece in range(index, plan.stages, stages)]
    return Stage([layer for piece in pieces for layer in piece.layers], index, plan, [len(p.layers) for p in pieces],
                 [k for piece in pieces for k in piece.positions])


def build_stage(model, index: int, plan: Partition) -> Stage:
    """Stage `index` of `plan` over `model`'s layers."""
    if not 0 <= index < plan.stages:
        raise PartitionError(f"stage {index} does not exist: the partition has stages 0..{plan.stages - 1}")
    if list(plan.names) != [n for n, _ in named_blocks(model)]:
        raise PartitionError("the partition was planned for another model: plan it with plan_stages(model, ...)")
    start, stop = plan.bounds[index]
    return Stage([layer for _, layer in named_blocks(model)[start:stop]], index, plan, positions=range(start, stop))
