"""The optimizer side of data parallelism: the LR scaled by world size, reached by a warmup.

Gradients are averaged in hvd_runtime.tf.gradients, not here: Keras 3 optimizers are used as
they are, which is what keeps `model.fit`-era code and Horovod's Keras wrappers out of the way.
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from hvd_runtime.scaling import lr_scaler
from hvd_runtime.tf.context import Context


@keras.saving.register_keras_serializable(package="hvd_runtime")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """lr x scaler, reached by a linear ramp from the one-rank lr over `warmup_steps` steps.

    Starting at the full scaled LR from random weights often diverges (Goyal et al., 2017). The
    step is the optimizer's own iteration count, which checkpoints carry, so a resumed run picks
    the ramp up where it stopped. With `follow` ("size" or "local_size"), the scaler is that
    Horovod count read inside the step, so after an elastic reset the LR fits the new world.
    """

    def __init__(self, lr: float, scaler: float, warmup_steps: int, follow: str | None = None):
        if follow not in (None, "size", "local_size"):
            raise ValueError(f"WarmupSchedule follow must be None, 'size' or 'local_size', got {follow!r}")
        self.lr, self.scaler, self.warmup_steps, self.follow = float(lr), float(scaler), int(warmup_steps), follow

    def _scaler(self):
        import horovod.tensorflow as hvd

        count = hvd.size_op() if self.follow == "size" else hvd.local_size_op()
        return tf.cast(count, tf.float32)

    def __call__(self, step):
        if self.follow is None and (self.warmup_steps <= 0 or self.scaler == 1.0):
            return tf.constant(self.lr * self.scaler, tf.float32)
        target = self.lr * (self._scaler() if self.follow else self.scaler)
        if self.warmup_steps <= 0:
            return target
        progress = tf.minimum(tf.cast(step, tf.float32) / self.warmup_steps, 1.0)
        return self.lr + (target - self.lr) * progress

    def get_config(self):
        return {"lr": self.lr, "scaler": self.scaler, "warmup_steps": self.warmup_steps, "follow": self.follow}


def _decay(cfg) -> float | None:
    return cfg.weight_decay or None


# Keras 3 applies weight_decay decoupled from the gradient (AdamW-style) for every optimizer.
OPTIMIZERS = {
    "sgd": lambda cfg, lr, **clip: keras.optimizers.SGD(lr, momentum=cfg.momentum, weight_decay=_decay(cfg), **clip),
    "adam": lambda cfg, lr, **clip: keras.optimizers.Adam(lr, weight_decay=_decay(cfg), **clip),
    "adamw": lambda cfg, lr, **clip: keras.optimizers.AdamW(lr, weight_decay=cfg.weight_decay, **clip),
}


def followed_count(optim_cfg, hvd_cfg, gpu_allreduce: bool) -> str | None:
    """In an elastic job (horovodrun sets HOROVOD_ELASTIC), the Horovod count lr_scaler scales by."""
    if os.environ.get("HOROVOD_ELASTIC") != "1":
        return None
    if hvd_cfg.adasum:
        return "local_size" if gpu_allreduce else None
    return "size" if optim_cfg.scale_lr else None


def make_optimizer(optim_cfg, hvd_cfg, ctx: Context, steps_per_epoch: int, *,
                   clip: bool = True) -> keras.optimizers.Optimizer:
    """A plain Keras optimizer whose LR follows WarmupSchedule.

    One optimizer step is `backward_passes_per_step` batches, so the warmup is counted in those.
    With `clip` (and optim.clip_norm > 0) it clips gradients by their global norm as it applies
    them, which in TrainStep is after the allreduce. A pipeline stage and a tensor-parallel model
    pass clip=False: each holds part of the model, and the whole model's norm is summed over the
    ranks holding the parts (the pipeline engine; TrainStep's grad_norm).
    """
    import horovod.tensorflow as hvd

    if optim_cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optim.name {optim_cfg.name!r}: choose one of {', '.join(OPTIMIZERS)}")
    if hvd_cfg.backward_passes_per_step < 1:
        raise ValueError(f"horovod.backward_passes_per_step must be at least 1, got {hvd_cfg.backward_passes_per_step}")
    gpu_allreduce = hvd.nccl_built() and ctx.device.startswith("GPU")
    scaler = lr_scaler(ctx.data_size, ctx.local_size, optim_cfg.scale_lr, hvd_cfg.adasum, bool(gpu_allreduce))
    optimizer_steps = max(1, steps_per_epoch // hvd_cfg.backward_passes_per_step)
    schedule = WarmupSchedule(optim_cfg.lr, scaler, int(round(optim_cfg.warmup_epochs * optimizer_steps)),
                              follow=followed_count(optim_cfg, hvd_cfg, bool(gpu_allreduce)))
    clipping = {"global_clipnorm": optim_cfg.clip_norm} if clip and optim_cfg.clip_norm else {}
    return OPTIMIZERS[optim_cfg.name](optim_cfg, schedule, **clipping)
