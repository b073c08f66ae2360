"""Every tf.function of the runtime is made here: traced as written, without AutoGraph.

AutoGraph rewrites each Python function a trace reaches, Keras' own optimizer and layers
included, into graph control flow, by parsing and transforming its source: about 0.9 s of CPU in
every TensorFlow rank of a small project (a third of its CPU after the import), spent before the
first step. Nothing traced here needs it. Keras 3's layers, losses and optimizers are written for
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
