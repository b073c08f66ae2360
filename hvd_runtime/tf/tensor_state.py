"""Which variables of a tensor-parallel Keras model are slices, of what, and the clipping norm over them.

The TensorFlow side of `hvd_runtime.torch.tensor_state`. Each split variable's Slicing says the
unsplit variable's shape, the axis it was cut along and the positions this rank holds: where a
sharded checkpoint places the slice (hvd_runtime.tf.checkpoint). A checkpoint written before
shards is the lists of the whole model's variables and the optimizer's, in order (apply_tp
keeps the whole model's variable order): each rank takes its slices of them. An optimizer
variable made for a model variable (momentum, Adam's moments) is named after that variable's
path by Keras, and is sliced with it.

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
class Slicing:
    """How one variable is split: along `axis`, this rank holding the original positions `index`
    of the unsplit variable's `shape`."""

    axis: int
    index: np.ndarray
    group: TensorGroup
    shape: tuple[int, ...]


def _slicings(model) -> dict[int, Slicing]:
    """id(variable) -> Slicing, for the variables of every split layer (Keras kernels are (in, out))."""
    slicings = {}
    sliced = [d for layer in model.layers for d in [layer, *vars(layer).values()]
             if isinstance(d, (ColumnParallelDense, RowParallelDense, VocabParallelEmbedding))]
    for layer in sliced:
        if isinstance(layer, VocabParallelEmbedding):
            slicings[id(layer.embeddings)] = Slicing(0, layer.source_index, layer.group, layer.whole_shape)
        elif isinstance(layer, ColumnParallelDense):
            slicings[id(layer.kernel)] = Slicing(1, layer.source_index, layer.group, layer.whole_kernel_shape)
            if layer.bias is not None:
                slicings[id(layer.bias)] = Slicing(0, layer.source_index, layer.group, layer.whole_kernel_shape[1:])
        elif isinstance(layer, RowParallelDense):
            slicings[id(layer.kernel)] = Slicing(0, layer.source_index, layer.group, layer.whole_kernel_shape)
    return slicings


def _take(array: np.ndarray, slicing: Slicing) -> np.ndarray:
    return np.take(array, slicing.index, axis=slicing.axis)


class SlicedVariables:
    """Which variables apply_tp split and how; the checkpoint and clipping views built on that."""

    def __init__(self, model):
        self.model = model
        self.by_id = _slicings(model)

    def optimizer_slicings(self, optimizer) -> list[Slicing | None]:
        """The Slicing of each optimizer variable: its model variable's, found by the path Keras names it after."""
        prefixes = sorted(((v.path.replace("/", "_") + "_", self.by_id.get(id(v))) for v in self.model.variables),
                          key=lambda item: -len(item[0]))
        return [next((slicing for prefix, slicing in prefixes if v.name.startswith(prefix)), None)
                for v in optimizer.variables]

    def model_slicings(self) -> list[Slicing | None]:
        return [self.by_id.get(id(v)) for v in self.model.variables]

    def local_model_arrays(self, arrays) -> list[np.ndarray]:
        return [a if s is None else _take(a, s) for a, s in zip(arrays, self.model_slicings())]

    def local_optimizer_arrays(self, optimizer, arrays) -> list[np.ndarray]:
        return [a if s is None else _take(a, s) for a, s in zip(arrays, self.optimizer_slicings(optimizer))]

    def saved_model_shapes(self) -> list[tuple[int, ...]]:
        """The shapes the model's variables have in a checkpoint (the unsplit ones)."""
        return self._saved_shapes(self.model.variables, self.model_slicings())

    def saved_optimizer_shapes(self, optimizer) -> list[tuple[int, ...]]:
        return self._saved_shapes(optimizer.variables, self.optimizer_slicings(optimizer))

    @staticmethod
    def _saved_shapes(variables, slicings) -> list[tuple[int, ...]]:
        return [tuple(v.shape) if s is None else tuple(s.shape) for v, s in zip(variables, slicings)]

    def grad_norm(self, grads, variables) -> tf.Tensor:
        """The whole model's gradient L2 norm, the same on every rank of a tensor-parallel group."""
        import horovod.tensorflow as hvd

        split_sq, whole_sq = tf.zeros((), tf.float32), tf.zeros((), tf.float32)
        group = None
        for g, v in zip(grads, variables):
            if g is None:
                continue
            squares = tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))
            slicing = self.by_id.get(id(v))
            if slicing is None:
                whole_sq += squares
            else:
                split_sq, group = split_sq + squares, slicing.group
        if group is not None:
            split_sq = hvd.allreduce(split_sq, op=hvd.Sum, process_set=group.process_set, name="tp.grad_norm")
        return tf.sqrt(split_sq + whole_sq)
