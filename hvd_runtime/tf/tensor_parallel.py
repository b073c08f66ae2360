"""Tensor parallelism (Megatron-LM's split dense layers) over a Horovod process set, for Keras 3.

The TensorFlow side of `hvd_runtime.torch.tensor_parallel`, with the same layout and the same
split (see there): a column-parallel Dense keeps this rank's slice of the output features (Keras
kernels are (in, out), so its columns), a row-parallel Dense the matching slice of the input
features (the kernel's rows), summed over the group. Megatron's f and g are `tf.custom_gradient`
functions over Horovod's allreduce in the group's process set.

`apply_tp(model, group)` returns a new keras.Sequential of the generated GPT's layers with each
transformer block split (attention by heads, the MLP's `fc` column- and `out` row-parallel); the
embedding, LayerNorms and head are the model's own layer objects, whole on every rank.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from hvd_runtime.parallel.tensor_groups import TensorGroup, TensorParallelError, check_block_splits, split_range

__all__ = ["ColumnParallelDense", "RowParallelDense", "TensorGroup", "TensorParallelBlock", "TensorParallelError",
           "apply_tp", "is_transformer_block"]


def _sum_over(tensor, group: TensorGroup):
    import horovod.tensorflow as hvd

    return hvd.allreduce(tensor, op=hvd.Sum, process_set=group.process_set)


def _copy_to_group(x, group: TensorGroup):
    """f: identity forward, gradient summed over the group backward."""
    @tf.custom_gradient
    def f(x):
        return tf.identity(x), lambda dy: _sum_over(dy, group)
    return f(x)


def _sum_over_group(x, group: TensorGroup):
    """g: partial results summed over the group forward, identity backward."""
    @tf.custom_gradient
    def g(x):
        return _sum_over(x, group), lambda dy: dy
    return g(x)


class _SplitDense(keras.layers.Layer):
    """A slice of a built Dense's kernel (and bias), as new variables of this layer."""

    def __init__(self, dense: keras.layers.Dense, group: TensorGroup, kernel: np.ndarray, bias: np.ndarray | None,
                 source_index: np.ndarray):
        # One name on every rank: in a tf.function, op names (and so Horovod's tensor names) must match.
        super().__init__(dtype=dense.dtype_policy, name=f"{dense.name}_tp")
        self.group, self.source_index = group, source_index
        # The unsplit Dense it came from, not tracked: its weights are not this layer's to train.
        object.__setattr__(self, "source", dense)
        self.activation = dense.activation
        self.kernel = self.add_weight(shape=kernel.shape, initializer="zeros", name="kernel")
        self.kernel.assign(kernel)
        self.bias = None
        if bias is not None:
            self.bias = self.add_weight(shape=bias.shape, initializer="zeros", name="bias")
            self.bias.assign(bias)


class ColumnParallelDense(_SplitDense):
    """A Dense whose output features are split: this rank computes its slice of them (then its activation).

    chunks: the output features are that many equal parts, each split over the group (a fused
    q, k, v projection). `source_index` lists the original output features held, in order.
    """

    def __init__(self, dense: keras.layers.Dense, group: TensorGroup, chunks: int = 1):
        if dense.units % chunks:
            raise TensorParallelError(f"Dense {dense.name!r} ({dense.units} units) does not divide into {chunks} "
                                      "equal chunks of output features")
        chunk = dense.units // chunks
        part = split_range(chunk, group.size, group.rank, f"column-parallel Dense {dense.name!r} ({dense.units} units)")
        index = np.concatenate([np.arange(c * chunk + part.start, c * chunk + part.stop) for c in range(chunks)])
        bias = dense.bias.numpy()[index] if dense.use_bias else None
        super().__init__(dense, group, dense.kernel.numpy()[:, index], bias, index)

    def call(self, x):
        y = ops.matmul(_copy_to_group(x, self.group), ops.cast(self.kernel, x.dtype))
        if self.bias is not None:
            y = y + ops.cast(self.bias, y.dtype)
        return self.activation(y)


class RowParallelDense(_SplitDense):
    """A Dense whose input features are split: this rank multiplies its slice, the group sums."""

    def __init__(self, dense: keras.layers.Dense, group: TensorGroup):
        if dense.activation not in (keras.activations.linear, None):
            raise TensorParallelError(f"row-parallel Dense {dense.name!r} has an activation, which must follow the "
                                      "sum over the group: split a Dense without one")
        features = dense.kernel.shape[0]
        part = split_range(features, group.size, group.rank, f"row-parallel Dense {dense.name!r} ({features} inputs)")
        index = np.arange(part.start, part.stop)
        super().__init__(dense, group, dense.kernel.numpy()[index], dense.bias.numpy() if dense.use_bias else None,
                         index)

    def call(self, x):
        y = _sum_over_group(ops.matmul(x, ops.cast(self.kernel, x.dtype)), self.group)
        return y if self.bias is None else y + ops.cast(self.bias, y.dtype)


class TensorParallelBlock(keras.layers.Layer):
    """A pre-norm transformer block (the generated GPT's `Block`) with its heads and MLP split over the group."""

    def __init__(self, block: keras.layers.Layer, group: TensorGroup):
        super().__init__(dtype=block.dtype_policy, name=f"{block.name}_tp")
        check_block_splits(block.heads, block.rate, group.size)
        self.heads, self.local = block.heads // group.size, block.width // group.size
        # The block's own layers in its order: the split model's variables line up with the
        # unsplit model's (hvd_runtime.tf.tensor_state relies on it for checkpoints).
        self.norm1 = block.norm1
        self.qkv = ColumnParallelDense(block.qkv, group, chunks=3)
        self.proj = RowParallelDense(block.proj, group)
        self.norm2 = block.norm2
        self.fc = ColumnParallelDense(block.fc, group)
        self.out = RowParallelDense(block.out, group)

    def call(self, x):
        tokens = ops.shape(x)[1]
        q, k, v = (ops.reshape(t, (-1, tokens, self.heads, self.local // self.heads))
                   for t in ops.split(self.qkv(self.norm1(x)), 3, axis=-1))
        attended = ops.reshape(ops.dot_product_attention(q, k, v, is_causal=True), (-1, tokens, self.local))
        x = x + self.proj(attended)
        return x + self.out(self.fc(self.norm2(x)))


def is_transformer_block(layer) -> bool:
    """Whether apply_tp splits `layer`: the generated GPT's Block (qkv, proj, fc and out Dense, heads)."""
    return (all(isinstance(getattr(layer, name, None), keras.layers.Dense) for name in ("qkv", "proj", "fc", "out"))
            and isinstance(getattr(layer, "heads", None), int))


def apply_tp(model: keras.Model, group: TensorGroup) -> keras.Model:
    """A keras.Sequential of `model`'s layers, each transformer block split over the group
    (`model` itself for a group of one: tp 1 is the unsplit model)."""
    if not any(is_transformer_block(layer) for layer in model.layers):
        raise TensorParallelError(f"{type(model).__name__} has no transformer blocks to split (attention with "
                                  "qkv and proj, an MLP of fc and out): tensor parallelism splits the gpt model; "
                                  "use --strategy data, model-split or pipeline for this one")
    if group.size == 1:
        return model
    layers = [TensorParallelBlock(layer, group) if is_transformer_block(layer) else layer for layer in model.layers]
    inputs = model.inputs[0]
    return keras.Sequential([keras.Input(inputs.shape[1:], dtype=inputs.dtype), *layers])
