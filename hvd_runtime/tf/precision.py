"""Mixed precision under Horovod on Keras 3: a dtype policy for the model, loss scaling for fp16.

bf16 keeps fp32's exponent range, so it needs no loss scaling: Keras' `mixed_bfloat16` policy
alone (layers compute in bf16, variables and the loss stay fp32), on CPU or GPU. fp16 does:
`mixed_float16`, and the optimizer wrapped in Keras' LossScaleOptimizer. Under Horovod the
order matters, and TrainStep keeps it: the scaled loss is differentiated, the *scaled* gradients
are allreduced, then `apply_gradients` unscales them, skips the step if any is not finite, and
clips by global norm inside the inner optimizer. Every rank unscales the same averaged
gradients, so every rank skips the same overflowed steps and the replicas never drift apart.

The policy is global and must be set before the model is built: call `use_precision` first.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from hvd_runtime.config import ConfigError

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def use_precision(name: str, device: str, *, pipeline: bool = False) -> None:
    """Make every layer built from now on compute in `name`'s dtype (variables stay fp32)."""
    if name not in POLICIES:
        raise ConfigError(f"train.precision is {name!r}: choose one of {', '.join(POLICIES)}")
    if name == "fp16" and not device.upper().startswith("GPU"):
        raise ConfigError("train.precision fp16 needs a GPU (its loss scaling exists for GPU half precision): "
                          "use bf16 on the CPU, or fp32")
    if name == "fp16" and pipeline:  # one loss scale would have to be agreed by every stage, every step
        raise ConfigError("train.precision fp16 is not offered for the pipeline strategy: use bf16 (no loss "
                          "scaling needed), or fp32")
    keras.mixed_precision.set_global_policy(POLICIES[name])


def loss_scaled(optimizer: keras.optimizers.Optimizer, name: str) -> keras.optimizers.Optimizer:
    """fp16: the optimizer behind Keras' dynamic loss scaling; otherwise the optimizer as it is."""
    return keras.optimizers.LossScaleOptimizer(optimizer) if name == "fp16" else optimizer


def is_loss_scaled(optimizer) -> bool:
    """Whether `optimizer` is Keras' LossScaleOptimizer, which skips overflowed updates itself."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def poisoned(loss):
    """`loss`, times 1 where it is finite and NaN where not: a non-finite loss's gradients are all NaN."""
    finite = tf.math.is_finite(tf.stop_gradient(loss))
    return loss * tf.cast(tf.where(finite, 1.0, float("nan")), loss.dtype)
