"""What a Keras rank's share of the model will take (hvd_runtime.memory_plan), counted from its
variables' shapes before any value is drawn (hvd_runtime.tf.meta_init). Keras has no device on
which a forward costs nothing, so the plan goes without activations."""

from __future__ import annotations

import math

from hvd_runtime.memory_plan import MemoryPlan, settle
from hvd_runtime.tf.meta_init import is_meta

__all__ = ["held_parameters", "plan_and_check"]


def held_parameters(module) -> int:
    """Elements of the trainable variables of `module` (a model, or a pipeline Stage's layers), a
    shared one once."""
    layers = module.layers if hasattr(module, "layers") else [module]
    variables = {id(v): v for layer in layers for v in layer.trainable_variables}
    return sum(math.prod(v.shape) for v in variables.values())


def plan_and_check(module, ctx, cfg, splits: str, meta: bool | None = None) -> MemoryPlan | None:
    """The plan for `module`, this rank's share without values yet, printed by rank 0; refuses
    (ConfigError) what this host cannot hold. Every rank plans or none does (the verdict is a
    collective): `meta`, whether the whole model has no values yet, decides for a stage, which may
    hold no variable at all."""
    if not (is_meta(module) if meta is None else meta):
        return None   # made real already: nothing left to plan
    # ZeRO steps a copy of this rank's rows, and tape.gradient hands a pass's gradients over whole
    return settle(held_parameters(module), None, ctx, cfg, splits, rows_copy=True)
