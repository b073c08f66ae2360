"""A Keras variable's name in the whole model: the path to it through the model's layers.

The index of its top-level layer (`model.layers`; a pipeline stage keeps its layers' indices),
then the attributes leading to it (a nested Sequential's layers by their index), then its own
attribute: `2.qkv.kernel`, `0.tokens.embeddings`, `1.0.kernel`, as a torch state_dict names
parameters. Split layers sit under the attributes of the layers they replace, so a
tensor-parallel slice has the name of the unsplit variable it is cut from. A variable reached
twice (a head tied to the embedding) has its first name. Checkpoints store variables under these
names (hvd_runtime.tf.checkpoint) and initial values are drawn by them (hvd_runtime.tf.meta_init).
"""

from __future__ import annotations

import keras

__all__ = ["is_state", "whole_names"]


def is_state(variable) -> bool:
    """A float variable: what a model's checkpoint holds (integer ones are Dropout's seed states)."""
    return "float" in str(variable.dtype)


def _top_layers(module) -> list[tuple[int, object]]:
    """(index in the whole model's layers, layer): a stage's own indices, a model's in order."""
    positions = getattr(module, "positions", None)
    return list(zip(positions, module.layers)) if positions is not None else list(enumerate(module.layers))


def whole_names(module) -> dict[int, str]:
    """id(variable) -> its name in the whole model, for every float variable `module` (a Keras
    model or a pipeline stage) holds."""
    held = {id(v) for v in module.variables if is_state(v)}
    names: dict[int, str] = {}

    def walk(obj, prefix: str, seen: set) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, keras.Model):   # a nested Sequential's (or functional model's) layers, by index
            for k, layer in enumerate(obj.layers):
                walk(layer, f"{prefix}.{k}", seen)
        for attr, value in vars(obj).items():
            key = f"{prefix}.{attr.lstrip('_')}"
            if isinstance(value, keras.Variable):
                if id(value) in held:
                    names.setdefault(id(value), key)
            elif attr.startswith("_"):
                continue
            elif isinstance(value, keras.layers.Layer):
                walk(value, key, seen)
            elif isinstance(value, (list, tuple)):
                for k, item in enumerate(value):
                    if isinstance(item, keras.layers.Layer):
                        walk(item, f"{key}.{k}", seen)

    for position, layer in _top_layers(module):
        walk(layer, str(position), set())
        for k, v in enumerate(layer.variables):  # one no attribute holds
            if id(v) in held:
                names.setdefault(id(v), f"{position}.variables.{k}")
    return names
