"""Sharded data parallelism for a Keras model (`horovod.zero: 1 | 2`), over the data-parallel ranks.

    sync = ZeroSync(model.trainable_variables, stage, ctx.dp_set, ctx.data_rank, ctx.data_size)
    step = TrainStep(model, optimizer, loss_fn, sync, ..., grad_norm=sync.grad_norm)

Each of N ranks owns rows (dim 0) of every variable, dealt as Horovod's reduce-scatter deals them
(hvd_runtime.zero_rows), and keeps them in a variable of its own (`stepped`), which the
Keras optimizer steps: its slots (momentum, Adam's moments) are built over the rows, so each rank
holds 1/N of the optimizer state. A variable of fewer rows than ranks stays whole, its gradient
allreduced and the variable itself stepped. TrainStep drives it as it drives GradientSync:
`sync(grads, variables)` reduce-scatters the gradients (averaged) into this rank's rows,
`applies_to` names what the optimizer steps, and `applied()` all-gathers every rank's updated
rows into the model's variables.

- stage 1: the step's gradients are reduce-scattered once, at the update.
- stage 2: under `backward_passes_per_step` each pass's gradients are reduce-scattered as it
  ends and only their rows are summed, so between passes a rank keeps 1/N of the gradients.
  (`tape.gradient` hands a pass's gradients over all at once: within a pass they are whole.)

The global gradient norm (clipping, the non-finite check) sums the rows' squares over the set, the
whole variables counted once, so every rank clips and decides alike. Checkpoints write each rank's
rows of the optimizer slots under their whole-model names (hvd_runtime.tf.checkpoint).
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from hvd_runtime.zero_rows import is_cut, row_range

__all__ = ["ZeroSync"]


class ZeroSync:
    """This rank's rows of each variable, and ZeRO's collectives around the optimizer's update."""

    def __init__(self, variables: Sequence, stage: int, process_set, dp_rank: int, dp_size: int,
                 device: str = "CPU:0"):
        """`device`: where the variables live; on CPU the reduce-scatter is one all-to-all (as
        hvd_runtime.torch.zero's: Gloo's reduce-scatter costs more than an allreduce)."""
        import horovod.tensorflow as hvd

        self._hvd, self.stage, self.process_set = hvd, stage, process_set
        self.size, self.rank, self.alltoall = dp_size, dp_rank, not device.upper().startswith("GPU")
        self.scatters_each_pass = stage == 2   # stage 2: only rows are summed over backward passes
        self.variables = list(variables)
        self.rows = [row_range(int(v.shape[0]), dp_rank, dp_size) if is_cut(tuple(v.shape), dp_size) else None
                     for v in self.variables]
        self.stepped = [v if rows is None else
                        keras.Variable(tf.convert_to_tensor(v)[rows[0]:rows[1]], dtype=v.dtype,
                                       name=f"hvd_zero_rows_{i}")
                        for i, (v, rows) in enumerate(zip(self.variables, self.rows))]

    def applies_to(self, variables: Sequence) -> list:
        """What the optimizer steps for `variables` (the model's trainable ones): the rows."""
        return self.stepped

    def take_rows(self) -> None:
        """Each stepped row variable set from its model variable (after a restore): eager."""
        for v, s, rows in zip(self.variables, self.stepped, self.rows):
            if rows is not None:
                s.assign(tf.convert_to_tensor(v)[rows[0]:rows[1]])

    def __call__(self, grads: Sequence, variables: Sequence) -> list:
        """The averaged gradients of this rank's rows (reduce-scattered) and of the whole variables
        (allreduced), in `applies_to`'s order."""
        hvd = self._hvd
        # dense, each of its variable's static shape (an embedding's IndexedSlices converts to an unknown one)
        grads = [tf.zeros_like(v) if g is None else tf.reshape(tf.convert_to_tensor(g), v.shape)
                 for g, v in zip(grads, self.variables)]
        out = list(grads)
        cut = [i for i, rows in enumerate(self.rows) if rows is not None]
        whole = [i for i, rows in enumerate(self.rows) if rows is None]
        if cut:
            # Horovod: each rank receives the average of its rows only
            scatter = self._by_alltoall if self.alltoall else lambda tensors: hvd.grouped_reducescatter(
                tensors, op=hvd.Average, process_set=self.process_set)
            for i, g in zip(cut, scatter([grads[i] for i in cut])):
                out[i] = g
        if whole:
            for i, g in zip(whole, hvd.grouped_allreduce([grads[i] for i in whole], op=hvd.Average,
                                                        name="zero.whole_grads", process_set=self.process_set)):
                out[i] = g
        return out

    def _by_alltoall(self, tensors: list) -> list:
        """A reduce-scatter as one all-to-all: every rank sends each other rank that rank's rows of
        each tensor, and averages what it receives, its own rows from every rank."""
        cuts = [[row_range(int(t.shape[0]), r, self.size) for r in range(self.size)] for t in tensors]
        send = tf.concat([tf.reshape(t[a:b], [-1]) for r in range(self.size)
                          for t, cut in zip(tensors, cuts) for a, b in [cut[r]]], axis=0)
        splits = [sum((cut[r][1] - cut[r][0]) * int(t.shape[1:].num_elements()) for t, cut in zip(tensors, cuts))
                  for r in range(self.size)]
        received, _ = self._hvd.alltoall(send, splits=tf.constant(splits, tf.int32), name="zero.grads",
                                         process_set=self.process_set)
        summed = tf.reduce_sum(tf.reshape(received, [self.size, -1]), axis=0) / self.size
        rows, at = [], 0
        for t, cut in zip(tensors, cuts):
            a, b = cut[self.rank]
            count = (b - a) * int(t.shape[1:].num_elements())
            rows.append(tf.reshape(summed[at:at + count], [b - a, *t.shape[1:]]))
            at += count
        return rows

    def applied(self) -> None:
        """Every rank's updated rows all-gathered into the model's variables."""
        cut = [i for i, rows in enumerate(self.rows) if rows is not None]
        if cut:
            # Horovod: the whole variables again, from every rank's rows
            gathered = self._hvd.grouped_allgather([tf.convert_to_tensor(self.stepped[i]) for i in cut],
                                                   name="zero.rows", process_set=self.process_set)
            for i, value in zip(cut, gathered):
                self.variables[i].assign(value)

    def grad_norm(self, grads: Sequence, variables: Sequence) -> tf.Tensor:
        """The whole model's gradient norm from `grads` (as __call__ returns them): the rows' squares
        summed over the set, the whole variables' counted once."""
        rows = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
                for g, r in zip(grads, self.rows) if g is not None and r is not None]
        whole = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
                 for g, r in zip(grads, self.rows) if g is not None and r is None]
        total = self._hvd.allreduce(tf.add_n(rows) if rows else tf.constant(0.0), op=self._hvd.Sum,
                                    name="zero.grad_norm", process_set=self.process_set)
        return tf.sqrt(total + (tf.add_n(whole) if whole else 0.0))

    def rows_by_variable(self) -> dict[int, tuple[object, tuple[int, int]]]:
        """id(model variable) -> (the variable the optimizer steps for it, its rows), for the cut ones."""
        return {id(v): (s, rows) for v, s, rows in zip(self.variables, self.stepped, self.rows) if rows is not None}
