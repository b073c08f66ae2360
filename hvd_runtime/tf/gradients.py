"""From this rank's gradients to the step's gradients: one grouped allreduce, local ones left out.

Horovod's `DistributedGradientTape` allreduces inside `tape.gradient()`. Two things this runtime
needs do not fit there. Gradient accumulation must sum several batches locally *before* one
allreduce. Local variables (a per-rank head, a model-parallel shard) must skip the allreduce,
and Horovod's way of marking them (`register_local_source`, `PartialDistributedGradientTape`)
calls `.ref()`, which Keras 3 variables do not have. So the allreduce is its own step, after
`tape.gradient()`, using the same Horovod op the tape uses (`grouped_allreduce`, with the same
compression and reduction options), and local variables are recognised by identity.

A local variable's gradient is used as this rank computed it. For a private per-rank variable
that is the gradient of this rank's loss. For a model-parallel shard whose output every rank
gathers with `hvd.allgather` (all ranks computing the same loss), Horovod's allgather gradient
averages the ranks' identical output gradients, so the shard's gradient is exact. Replicated
layers *before* such a shard would each see only their own shard's share and need a sum, not an
average: put sharded layers first, as with sharded embedding tables.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import tensorflow as tf

from hvd_runtime.adasum import check_adasum


class GradientSync:
    """Average (or Adasum-combine) gradients across ranks, except those of local variables.

    What TrainStep drives (as it drives ZeRO's hvd_runtime.tf.zero.ZeroSync): `sync(grads,
    variables)`, the variables the optimizer then steps (`applies_to`: the same), `applied()`
    after the update (nothing here)."""

    scatters_each_pass = False   # the gradients of several backward passes are summed whole

    def __init__(self, fp16_compression: bool = False, adasum: bool = False,
                 local_variables: Iterable = (), process_set="global"):
        """process_set: where gradients are averaged (a tensor-parallel model's dp set, from
        ctx.dp_set); None when this rank is the only replica: nothing is averaged."""
        import horovod.tensorflow as hvd

        check_adasum(adasum, hvd)   # a ConfigError at start-up: Gloo has no Adasum op
        self._hvd = hvd
        self.process_set = hvd.global_process_set if process_set == "global" else process_set
        self.compression = hvd.Compression.fp16 if fp16_compression else hvd.Compression.none
        self.op = hvd.Adasum if adasum else hvd.Average
        self._local: dict[int, object] = {}   # id -> variable; holding it keeps the id unique
        self.register_local(local_variables)

    def register_local(self, variables: Iterable) -> None:
        """Keep these variables' gradients on this rank (never allreduced)."""
        for v in variables:
            self._local[id(v)] = v

    def is_local(self, variable) -> bool:
        return id(variable) in self._local

    def applies_to(self, variables: Sequence) -> list:
        return list(variables)

    def applied(self) -> None:
        pass

    def __call__(self, grads: Sequence, variables: Sequence) -> list:
        """`grads[i]` belongs to `variables[i]`; returns the gradients to apply, in the same order."""
        shared = [i for i, (g, v) in enumerate(zip(grads, variables)) if g is not None and not self.is_local(v)]
        out = list(grads)
        if shared and self.process_set is not None:
            dense = [tf.convert_to_tensor(grads[i]) for i in shared]  # IndexedSlices -> dense: one fused op
            reduced = self._hvd.grouped_allreduce(dense, op=self.op, compression=self.compression,
                                                  name="gradients", process_set=self.process_set)
            for i, g in zip(shared, reduced):
                out[i] = g
        return out


class GradientAccumulator:
    """Sum the gradients of `k` batches locally, so one allreduce serves `k` backward passes.

    The mean over the k batches is what is handed on, so the update matches one batch k times
    larger and the learning rate needs no change.
    """

    def __init__(self, variables: Sequence, k: int):
        if k < 1:
            raise ValueError(f"horovod.backward_passes_per_step must be at least 1, got {k}")
        self.k = k
        self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables]

    def add(self, grads: Sequence) -> None:
        for s, g in zip(self.sums, grads):
            if g is not None:
                s.assign_add(tf.convert_to_tensor(g))

    def mean_and_reset(self) -> list[tf.Tensor]:
        means = [tf.identity(s) / self.k for s in self.sums]
        for s in self.sums:
            s.assign(tf.zeros_like(s))
        return means
