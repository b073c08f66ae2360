"""A Keras run's model FLOPs and its devices' peak (hvd_runtime.mfu), counted by rank 0 at start-up.

The FLOPs of a forward are TensorFlow's profiler's counts (its float operations of each op) of
the graph of one sample's forward through the model as build_on_meta made it: tracing reads no
variable's value, so counting costs no arithmetic. They count the element-wise ops too (biases,
BatchNorm, additions), a little more than the matmuls and convolutions alone.
"""

from __future__ import annotations

import importlib

import numpy as np
from hvd_runtime.mfu import Utilization, counted, gpu_peak, measured_rate, precision_column
from hvd_runtime.tf.memory_plan import held_parameters
from hvd_runtime.tf.meta_init import is_meta

__all__ = ["count_utilization", "forward_flops"]


def forward_flops(model, sample_shape: tuple[int, ...], dtype) -> float:
    """FLOPs of one sample's forward through `model` (inputs of `sample_shape` and `dtype`), in
    inference mode: the ops of its traced graph that the input reaches, each as TensorFlow's
    profiler counts it. (A meta model's graph also draws its variables' initial values: those ops
    the input never reaches.)"""
    import tensorflow as tf
    from tensorflow.python.framework import ops
    from tensorflow.python.util import deprecation

    from hvd_runtime.tf.compiled import compiled
    importlib.import_module("tensorflow.python.profiler.internal.flops_registry")   # registers the counts

    traced = compiled(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec((1, *sample_shape), dtype))
    reached, todo = set(), [traced.inputs[0].op]
    while todo:
        op = todo.pop()
        if op.name not in reached:
            reached.add(op.name)
            todo.extend(consumer for out in op.outputs for consumer in out.consumers())
    total = 0
    with deprecation.silence():   # the counts are TF1's profiler's: they warn of their own helpers
        for name in reached:
            try:
                total += ops.get_stats_for_node_def(traced.graph, traced.graph.get_operation_by_name(name).node_def,
                                                    "flops").value or 0
            except ValueError:   # an op without a count (reshapes, identities)
                pass
    return float(total)


def _device_peak(ctx, precision: str) -> tuple[float, str] | None:
    """(peak FLOP/s of one of this rank's devices, its name) at `precision`; None for an unknown GPU."""
    import tensorflow as tf

    if ctx.device.startswith("GPU"):
        name = tf.config.experimental.get_device_details(tf.config.get_visible_devices("GPU")[0]).get("device_name", "")
        column = precision_column(precision, tf.config.experimental.is_tensor_float_32_execution_enabled())
        peak = gpu_peak(name, column)
        return None if peak is None else (peak, f"{name}, {column}")
    n = 512
    dtype = tf.bfloat16 if precision == "bf16" else tf.float32
    with tf.device(ctx.device):
        a = b = tf.fill((n, n), tf.constant(0.5, dtype))   # the values do not matter; no RNG is drawn from
        rate = measured_rate(lambda: tf.linalg.matmul(a, b).numpy(), 2.0 * n**3)
    return rate, f"CPU at its measured {precision} matmul rate"


def count_utilization(model, example: np.ndarray, ctx, cfg, language_model: bool) -> Utilization | None:
    """hvd_runtime.mfu.counted for the meta `model` on this rank's devices; None on the other ranks
    and for a model made real already. `example`: a batch of training inputs (shape, dtype)."""
    if not ctx.is_root or not is_meta(model):
        return None
    import tensorflow as tf

    per_rank = ctx.stage_devices if ctx.stage_devices and ctx.device.startswith("GPU") else 1
    return counted(cfg.model, language_model, lambda: held_parameters(model),
                   lambda: forward_flops(model, example.shape[1:], tf.as_dtype(example.dtype)),
                   lambda: _device_peak(ctx, cfg.train.precision), ctx.size * per_rank)
