"""A tensor-parallel Keras model's state in the unsplit model's format: gathered to save, sliced to load.

The TensorFlow side of `hvd_runtime.torch.tensor_state` (see there for why). A TF checkpoint is
the list of the model's variables and the list of the optimizer's, in order; apply_tp keeps the
unsplit model's variable order, so the gathered lists are the unsplit model's own. An optimizer
variable made for a model variable (momentum, Adam's moments) is named after that variable's
path by Keras, and is gathered and sliced with it.

The clipping norm is the whole model's: the split variables' squares summed over the group, the
whole ones counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from hvd_runtime.parallel.tensor_groups import TensorGroup
from hvd_runtime.tf.tensor_parallel import ColumnParallelDense, RowParallelDense, VocabParallelEmbedding


@dataclass(frozen=True)
class Split:
    """How one variable is split: along `axis`, this rank holding the original positions `index`."""

    axis: int
    index: np.ndarray
    group: TensorGroup


def _splits(model) -> dict[int, Split]:
    """id(variable) -> Split, for the variables of every split layer (Keras kernels are (in, out))."""
    splits = {}
    split = [d for layer in model.layers for d in [layer, *vars(layer).values()]
             if isinstance(d, (ColumnParallelDense, RowParallelDense, VocabParallelEmbedding))]
    for layer in split:
        if isinstance(layer, VocabParallelEmbedding):
            splits[id(layer.embeddings)] = Split(0, layer.source_index, layer.group)
        elif isinstance(layer, ColumnParallelDense):
            splits[id(layer.kernel)] = Split(1, layer.source_index, layer.group)
            if layer.bias is not None:
                splits[id(layer.bias)] = Split(0, layer.source_index, layer.group)
        elif isinstance(layer, RowParallelDense):
            splits[id(layer.kernel)] = Split(0, layer.source_index, layer.group)
    return splits


def _gather(array: np.ndarray, split: Split) -> np.ndarray:
    import horovod.tensorflow as hvd

    pieces = hvd.allgather(np.moveaxis(array, split.axis, 0), process_set=split.group.process_set).numpy()
    positions = hvd.allgather(split.index.astype(np.int64), process_set=split.group.process_set).numpy()
    whole = np.empty_like(pieces)
    whole[positions] = pieces
    return np.moveaxis(whole, 0, split.axis)


def _take(array: np.ndarray, split: Split) -> np.ndarray:
    return np.take(array, split.index, axis=split.axis)


class SplitVariables:
    """Which variables apply_tp split and how; the checkpoint and clipping views built on that."""

    def __init__(self, model):
        self.model = model
        self.by_id = _splits(model)

    def optimizer_splits(self, optimizer) -> list[Split | None]:
        """The Split of each optimizer variable: its model variable's, found by the path Keras names it after."""
        prefixes = sorted(((v.path.replace("/", "_") + "_", self.by_id.get(id(v))) for v in self.model.variables),
                          key=lambda item: -len(item[0]))
        return [next((split for prefix, split in prefixes if v.name.startswith(prefix)), None)
                for v in optimizer.variables]

    def model_splits(self) -> list[Split | None]:
        return [self.by_id.get(id(v)) for v in self.model.variables]

    def full_arrays(self, variables, splits) -> list[np.ndarray]:
        """The variables' values, split ones gathered whole; every rank of the job must call it."""
        import horovod.tensorflow as hvd

        whole = [np.asarray(v) if s is None else _gather(np.asarray(v), s) for v, s in zip(variables, splits)]
        # A barrier (horovod.tensorflow has no hvd.barrier): no group leaves the job while another still gathers.
        hvd.allreduce(tf.zeros(()), op=hvd.Sum, name="tp.gathered")
        return whole

    def full_model_arrays(self) -> list[np.ndarray]:
        return self.full_arrays(self.model.variables, self.model_splits())

    def whole_model(self, unsplit):
        """`unsplit` (a fresh build of the same model) holding the trained weights; every rank calls."""
        unsplit.set_weights(self.full_model_arrays())
        return unsplit

    def full_optimizer_arrays(self, optimizer) -> list[np.ndarray]:
        return self.full_arrays(optimizer.variables, self.optimizer_splits(optimizer))

    def local_model_arrays(self, arrays) -> list[np.ndarray]:
        return [a if s is None else _take(a, s) for a, s in zip(arrays, self.model_splits())]

    def local_optimizer_arrays(self, optimizer, arrays) -> list[np.ndarray]:
        return [a if s is None else _take(a, s) for a, s in zip(arrays, self.optimizer_splits(optimizer))]

    def saved_model_shapes(self) -> list[tuple[int, ...]]:
        """The shapes the model's variables have in a checkpoint (the unsplit ones)."""
        return self._saved_shapes(self.model.variables, self.model_splits())

    def saved_optimizer_shapes(self, optimizer) -> list[tuple[int, ...]]:
        return self._saved_shapes(optimizer.variables, self.optimizer_splits(optimizer))

    @staticmethod
    def _saved_shapes(variables, splits) -> list[tuple[int, ...]]:
        shapes = []
        for v, s in zip(variables, splits):
            shape = list(v.shape)
            if s is not None:
                shape[s.axis] *= s.group.size
            shapes.append(tuple(shape))
        return shapes

    def grad_norm(self, grads, variables) -> tf.Tensor:
        """The whole model's gradient L2 norm, the same on every rank of a tensor-parallel group."""
        import horovod.tensorflow as hvd

        split_sq, whole_sq = tf.zeros((), tf.float32), tf.zeros((), tf.float32)
        group = None
        for g, v in zip(grads, variables):
            if g is None:
                continue
            squares = tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))
            split = self.by_id.get(id(v))
            if split is None:
                whole_sq += squares
            else:
                split_sq, group = split_sq + squares, split.group
        if group is not None:
            split_sq = hvd.allreduce(split_sq, op=hvd.Sum, process_set=group.process_set, name="tp.grad_norm")
        return tf.sqrt(split_sq + whole_sq)
