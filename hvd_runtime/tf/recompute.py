"""Activation recomputation (`model.recompute: blocks`) for Keras: each block keeps only its input
for the backward pass and runs its `call` again there, under `tf.recompute_grad`.

The blocks are the model's layers (a keras.Sequential's), or a pipeline stage's. A block's other
arguments (`training`, a mask) are closed over, since tf.custom_gradient takes none in a compiled
step, and only its input is differentiated, with the variables it reads. A call with
`training=False` (evaluation) runs as it is; one without the argument is recomputed. The forward run
again must be the same computation, so a block that draws random numbers (dropout above 0) or
updates state in its forward (BatchNormalization's moving statistics) is refused in one line:
Keras' seed generators and moving averages would move on in the second run.
"""

from __future__ import annotations

import tensorflow as tf

from hvd_runtime.config import ConfigError

__all__ = ["recompute_blocks"]


def recompute_blocks(model):
    """Make every block of `model` (a keras.Sequential, or a pipeline Stage) recompute its
    activations in backward, in place; returns `model`."""
    import keras

    blocks = [(layer.name, layer) for layer in model.layers]
    for name, block in blocks:
        for layer in _sublayers(block):
            if isinstance(layer, keras.layers.Dropout) and layer.rate > 0:
                raise ConfigError(f"model.recompute blocks runs each block's forward twice, and block {name} draws "
                                  f"dropout masks (rate {layer.rate:g}) that would differ the second time: set "
                                  "model.dropout to 0, or model.recompute none")
            if isinstance(layer, keras.layers.BatchNormalization):
                raise ConfigError(f"model.recompute blocks runs each block's forward twice, and block {name} has "
                                  "BatchNormalization, whose moving statistics would be updated twice: use "
                                  "model.recompute none for this model")
    for _, block in blocks:
        if not getattr(block, "_hvd_recomputed", False):
            block.call = _recomputed(block.call)
            block._hvd_recomputed = True
    return model


def _sublayers(layer):
    yield layer
    for child in getattr(layer, "_flatten_layers", lambda **_: [])(include_self=False, recursive=True):
        yield child


def _recomputed(call):
    def recomputing_call(inputs, *args, **kwargs):
        if kwargs.get("training") is False:   # evaluation: no backward to keep anything for
            return call(inputs, *args, **kwargs)
        return tf.recompute_grad(lambda x: call(x, *args, **kwargs))(inputs)

    return recomputing_call
