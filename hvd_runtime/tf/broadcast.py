"""Rank 0's variables to every rank: one traced group of broadcasts, traced without AutoGraph.

Horovod's `broadcast_variables` traces its loop over the variables with AutoGraph, which parses
and rewrites that loop and Horovod's `broadcast` from their source before tracing them: CPU every
TensorFlow rank spent at its start and at every elastic sync (docs/tensorflow-steps.md), for a loop
over a Python list that traces as written. The broadcasts are Horovod's own.
"""

from __future__ import annotations

from collections.abc import Iterable

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_runtime.tf.compiled import compiled


@compiled
def _broadcast_group(variables: list[tf.Variable], root_rank: int) -> None:
    for variable in variables:
        variable.assign(hvd.broadcast(variable, root_rank))


def broadcast_variables(variables: Iterable[tf.Variable], root_rank: int = 0) -> None:
    """Every rank's `variables` (tf.Variables, in the same order on every rank) take root_rank's values."""
    _broadcast_group(list(variables), root_rank)
