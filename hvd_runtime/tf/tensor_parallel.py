"""Tensor parallelism (Megatron-LM's split dense layers) over a Horovod process set, for Keras 3.

The TensorFlow side of `hvd_runtime.torch.tensor_parallel`, with the same layout and the same
split (see there): a column-parallel Dense keeps this rank's slice of the output features (Keras
kernels are (in, out), so its columns), a row-parallel Dense the matching slice of the input
features (the kernel's rows), summed over the group. Megatron's f and g are `tf.custom_gradient`
functions over Horovod's allreduce in the group's process set.

`apply_tp(model, group)` returns a new keras.Sequential of the generated GPT's layers with each
transformer block split (attention by heads, the MLP's `fc` column- and `out` row-parallel, as
BLOCK_PLAN names them; the block's own `call` runs on the split layers), and
the token embedding and the head split by vocabulary rows, as in PyTorch: the logits stay split
over the vocabulary, for the loss and accuracy of `hvd_runtime.tf.vocab_parallel`, and a head
tied to the embedding multiplies by the embedding's own rows. Position embeddings and LayerNorms
are the model's own layer objects, whole on every rank.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from hvd_runtime.parallel.tensor_groups import (TensorGroup, TensorParallelError, check_block_splits, check_no_dropout,
                                                slice_range, vocab_range)
from hvd_runtime.tf.meta_init import take

__all__ = ["BLOCK_PLAN", "ColumnParallelDense", "RowParallelDense", "TensorGroup", "TensorParallelBlock",
           "TensorParallelEmbedding", "TensorParallelError", "TensorParallelHead", "VocabParallelEmbedding", "apply_tp",
           "is_transformer_block", "slice_layers", "sum_over_group"]


def _sum_over(tensor, group: TensorGroup):
    import horovod.tensorflow as hvd

    return hvd.allreduce(tensor, op=hvd.Sum, process_set=group.process_set)


def _copy_to_group(x, group: TensorGroup):
    """f: identity forward, gradient summed over the group backward."""
    @tf.custom_gradient
    def f(x):
        return tf.identity(x), lambda dy: _sum_over(dy, group)
    return f(x)


def sum_over_group(x, group: TensorGroup):
    """g: partial results summed over the group forward, identity backward."""
    @tf.custom_gradient
    def g(x):
        return _sum_over(x, group), lambda dy: dy
    return g(x)


class _SplitDense(keras.layers.Layer):
    """A slice of a Dense's kernel (and bias), as new variables of this layer (hvd_runtime.tf.meta_init.take:
    of a meta Dense, meta slices that materialize draws; of a built one, copies of its values)."""

    def __init__(self, dense: keras.layers.Dense, group: TensorGroup, source_index: np.ndarray, column: bool):
        # One name on every rank: in a tf.function, op names (and so Horovod's tensor names) must match.
        super().__init__(dtype=dense.dtype_policy, name=f"{dense.name}_tp")
        self.group, self.source_index = group, source_index
        self.whole_kernel_shape = tuple(dense.kernel.shape)   # where the slices sit (checkpoints)
        # The unsplit Dense it came from, not tracked: its weights are not this layer's to train.
        object.__setattr__(self, "source", dense)
        self.activation = dense.activation
        if column:   # Keras kernels are (in, out): the output features are the kernel's columns
            self.kernel = take(self, dense.kernel, "kernel", cols=source_index)
            self.bias = take(self, dense.bias, "bias", rows=source_index) if dense.use_bias else None
        else:
            self.kernel = take(self, dense.kernel, "kernel", rows=source_index)
            self.bias = take(self, dense.bias, "bias") if dense.use_bias else None


class ColumnParallelDense(_SplitDense):
    """A Dense whose output features are split: this rank computes its slice of them (then its activation).

    chunks: the output features are that many equal parts, each split over the group (a fused
    q, k, v projection). `part`: the features this rank holds when they are not an equal share (a
    head's vocabulary). `source_index` lists the original output features held, in order.
    """

    def __init__(self, dense: keras.layers.Dense, group: TensorGroup, chunks: int = 1, part: slice | None = None):
        if dense.units % chunks:
            raise TensorParallelError(f"Dense {dense.name!r} ({dense.units} units) does not divide into {chunks} "
                                      "equal chunks of output features")
        chunk = dense.units // chunks
        part = part or slice_range(chunk, group.size, group.rank,
                                   f"column-parallel Dense {dense.name!r} ({dense.units} units)")
        index = np.concatenate([np.arange(c * chunk + part.start, c * chunk + part.stop) for c in range(chunks)])
        super().__init__(dense, group, index, column=True)

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
        part = slice_range(features, group.size, group.rank, f"row-parallel Dense {dense.name!r} ({features} inputs)")
        super().__init__(dense, group, np.arange(part.start, part.stop), column=False)

    def call(self, x):
        y = sum_over_group(ops.matmul(x, ops.cast(self.kernel, x.dtype)), self.group)
        return y if self.bias is None else y + ops.cast(self.bias, y.dtype)


# How a transformer block splits, as in torch (hvd_runtime.torch.tensor_parallel.BLOCK_PLAN): each
# Dense of the block by its attribute name; (column-parallel?, chunks).
BLOCK_PLAN = {"qkv": (True, 3), "proj": (False, 1), "fc": (True, 1), "out": (False, 1)}


def _check_heads(block, tp: int) -> int:
    """The block's head count, checked against its qkv Dense and tp: one line if off."""
    heads = getattr(block, "heads", None)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise TensorParallelError(f"model.py's block {block.name!r} has no head count: tensor parallelism splits "
                                  "attention by heads and reads them from the block's `heads` (an int); "
                                  "keep `self.heads` in Block")
    if block.qkv.units % (3 * heads):
        raise TensorParallelError(f"model.py's block {block.name!r}: its qkv layer's {block.qkv.units} units are not "
                                  f"3 x {heads} heads of one width: make qkv 3 x width and width a multiple of heads")
    rate = getattr(block, "rate", None)   # the block's largest dropout: its `rate` and its Dropout layers'
    rates = [layer.rate for layer in vars(block).values() if isinstance(layer, keras.layers.Dropout)]
    check_block_splits(heads, max([*rates, float(rate)] if isinstance(rate, (int, float)) else rates, default=0.0), tp)
    return heads


class TensorParallelBlock(keras.layers.Layer):
    """The model's own transformer block with the Dense layers BLOCK_PLAN names split over the
    group, running the block's own `call`: every other attribute is the block's (its other layers
    the same objects, its numbers copied), `heads` this rank's share. An edited `Block.call`
    is what trains, at any tp."""

    def __init__(self, block: keras.layers.Layer, group: TensorGroup):
        super().__init__(dtype=block.dtype_policy, name=f"{block.name}_tp")
        heads = _check_heads(block, group.size)
        object.__setattr__(self, "source_call", type(block).call)  # not tracked: a function
        # The block's attributes in its order: the split model's variables line up with the
        # whole model's (hvd_runtime.tf.tensor_state relies on it for checkpoints).
        for name, value in vars(block).items():
            if name.startswith("_") or name in vars(self) or name in ("name", "built", "trainable"):
                continue
            if name in BLOCK_PLAN:
                column, chunks = BLOCK_PLAN[name]
                value = ColumnParallelDense(value, group, chunks=chunks) if column else RowParallelDense(value, group)
            elif not isinstance(value, (keras.layers.Layer, int, float, str, bool, type(None))):
                continue
            setattr(self, name, value)
        self.heads = heads // group.size

    def call(self, x, training=False):
        return self.source_call(self, x, training=training)


class VocabParallelEmbedding(keras.layers.Layer):
    """A keras Embedding whose rows (token ids) are split: this rank looks up its own, the group sums
    (a token outside its rows reads zeros here and its embedding from the rank holding it)."""

    def __init__(self, embedding: keras.layers.Embedding, group: TensorGroup):
        super().__init__(dtype=embedding.dtype_policy, name=f"{embedding.name}_tp")  # alike on every rank
        part = vocab_range(embedding.input_dim, group.size, group.rank)
        self.group, self.start, self.stop = group, part.start, part.stop
        self.source_index = np.arange(part.start, part.stop)  # the original rows (token ids) held
        self.whole_shape = tuple(embedding.embeddings.shape)
        self.embeddings = take(self, embedding.embeddings, "embeddings", rows=self.source_index)

    def call(self, idx):
        outside = ops.logical_or(idx < self.start, idx >= self.stop)
        rows = ops.take(self.embeddings, ops.where(outside, 0, idx - self.start), axis=0)
        rows = ops.where(ops.expand_dims(outside, -1), ops.zeros_like(rows), rows)
        return sum_over_group(ops.cast(rows, self.compute_dtype), self.group)


class TensorParallelEmbedding(keras.layers.Layer):
    """The generated GPT's `Embedding` with its token rows split over the group; positions stay whole."""

    def __init__(self, block: keras.layers.Layer, group: TensorGroup):
        super().__init__(dtype=block.dtype_policy, name=f"{block.name}_tp")
        check_no_dropout(block.rate)
        self.tokens = VocabParallelEmbedding(block.tokens, group)  # in the block's order: tokens, positions
        self.positions = block.positions

    def call(self, idx):
        return self.tokens(idx) + self.positions(ops.arange(ops.shape(idx)[1]))


class TensorParallelHead(keras.layers.Layer):
    """The generated GPT's `Head` answering this rank's vocabulary rows of the logits: its `out` Dense
    column-parallel over the vocabulary, or (tied) the split token embedding's rows."""

    def __init__(self, head: keras.layers.Layer, group: TensorGroup, tokens: VocabParallelEmbedding | None):
        super().__init__(dtype=head.dtype_policy, name=f"{head.name}_tp")
        self.group, self.norm, self.out = group, head.norm, None
        if not head.tied:
            self.out = ColumnParallelDense(head.out, group, part=vocab_range(head.vocab, group.size, group.rank))
        elif tokens is None:
            raise TensorParallelError("a head tied to the token embedding splits with it: keep both on one stage "
                                      "(model.tie_embeddings false in a pipeline)")
        object.__setattr__(self, "tokens", tokens)  # not tracked: the embedding's variable is the embedding's

    def call(self, x):
        x = self.norm(x)
        if self.out is not None:
            return self.out(x)
        rows = ops.cast(self.tokens.embeddings, x.dtype)
        return ops.matmul(_copy_to_group(x, self.group), ops.transpose(rows))


def is_transformer_block(layer) -> bool:
    """Whether apply_tp splits `layer`: a layer holding every Dense BLOCK_PLAN names."""
    return all(isinstance(getattr(layer, name, None), keras.layers.Dense) for name in BLOCK_PLAN)


def _is_embedding(layer) -> bool:
    return isinstance(getattr(layer, "tokens", None), keras.layers.Embedding)


def _is_head(layer) -> bool:
    return (isinstance(getattr(layer, "norm", None), keras.layers.LayerNormalization) and hasattr(layer, "tied")
            and isinstance(getattr(layer, "vocab", None), int))


def slice_layers(layers: list, group: TensorGroup) -> list:
    """`layers` (a model's or a pipeline stage's, in order) with the transformer blocks, the token
    embedding and the head split over the group; the others as they are."""
    split, tokens = [], None
    for layer in layers:
        if is_transformer_block(layer):
            layer = TensorParallelBlock(layer, group)
        elif _is_embedding(layer):
            layer = TensorParallelEmbedding(layer, group)
            tokens = layer.tokens
        elif _is_head(layer):
            layer = TensorParallelHead(layer, group, tokens)
        split.append(layer)
    return split


def apply_tp(model: keras.Model, group: TensorGroup) -> keras.Model:
    """A keras.Sequential of `model`'s layers split over the group (slice_layers); `model` itself for a
    group of one (tp 1 is the whole model). Its logits are then split over the vocabulary: train
    with hvd_runtime.tf.vocab_parallel's loss and accuracy."""
    if not any(is_transformer_block(layer) for layer in model.layers):
        raise TensorParallelError(f"{type(model).__name__} has no transformer blocks to split (attention with "
                                  "qkv and proj, an MLP of fc and out): tensor parallelism splits the gpt model; "
                                  "use --strategy data, model-split or pipeline for this one")
    if group.size == 1:
        return model
    inputs = model.inputs[0]
    return keras.Sequential([keras.Input(inputs.shape[1:], dtype=inputs.dtype), *slice_layers(model.layers, group)])
