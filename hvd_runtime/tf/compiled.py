"""Every tf.function of the runtime is made here: traced as written, without AutoGraph.

AutoGraph rewrites each Python function a trace reaches, Keras' own optimizer and layers
included, into graph control flow, by parsing and transforming its source: CPU every TensorFlow
rank spends before its first step (docs/tensorflow-steps.md). Nothing traced here needs it. Keras 3's layers, losses and optimizers are written for
backends without AutoGraph (`ops.cond`, never `if tensor:`), and the runtime's own steps branch
only on Python values fixed at trace time. A branch on a tensor would now fail the trace at once
(OperatorNotAllowedInGraphError: "Using a symbolic `tf.Tensor` as a Python `bool`"), never
change what is computed.
"""

from __future__ import annotations

import tensorflow as tf


def compiled(fn=None, **options):
    """tf.function(fn, autograph=False, **options); usable as a decorator, with options or bare."""
    if fn is None:
        return lambda f: tf.function(f, autograph=False, **options)
    return tf.function(fn, autograph=False, **options)


def compiled_for_any_batch(fn, at_least: int = 1, **options):
    """compiled(fn), traced once for every batch size: the first call fixes each tensor argument's
    dtype and all but its first dimension, and leaves that one open.

    A trace of a whole model's step costs seconds of CPU, and batches do change size: an epoch's last batch is short unless the data
    divides evenly, evaluation batches too. Traced for the first shape, a step is traced again on
    the first short batch (`reduce_retracing` then relaxes the shape: still two traces); traced
    for any batch size, once. The arguments are tensors or arrays (nested structures of them),
    each with a batch dimension, always of the same dtypes and trailing shapes.

    Calls go to the trace itself (its ConcreteFunction), not through tf.function, which looks the
    trace up again on every call from the arguments' types, a large part of a small model's call;
    a pipeline stage makes several such calls per micro-batch (docs/tensorflow-steps.md).

    at_least: batches smaller than this are traced per size instead (for a model whose trace
    depends on a small batch's exact size: ModelSplit cuts a batch into at most as many
    micro-batches as it has samples).
    """
    traced = None
    per_size = compiled(fn, **options) if at_least > 1 else None

    def call(*args):
        nonlocal traced
        if per_size is not None and _batch_size(args) < at_least:
            return per_size(*args)
        if traced is None:
            spec = tf.nest.map_structure(_any_batch_spec, list(args))
            traced = compiled(fn, input_signature=spec, **options).get_concrete_function()
        return traced(*args)

    call.__name__ = getattr(fn, "__name__", "compiled_for_any_batch")
    return call


def _any_batch_spec(value) -> tf.TensorSpec:
    t = tf.convert_to_tensor(value)
    return tf.TensorSpec([None, *t.shape[1:]], t.dtype)


def _batch_size(args) -> int:
    return int(tf.nest.flatten(args)[0].shape[0])
