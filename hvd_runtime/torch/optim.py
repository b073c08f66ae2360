"""The optimizer side of data parallelism: scaled LR with warmup, Horovod's DistributedOptimizer."""

from __future__ import annotations

import torch
from torch import nn

from hvd_runtime.torch.context import Context

OPTIMIZERS = {
    "sgd": lambda params, cfg, lr: torch.optim.SGD(params, lr=lr, momentum=cfg.momentum,
                                                   weight_decay=cfg.weight_decay),
    "adam": lambda params, cfg, lr: torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay),
    "adamw": lambda params, cfg, lr: torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay),
}


def lr_scaler(ctx: Context, scale_lr: bool, adasum: bool, nccl_built: bool) -> float:
    """Why the LR grows: averaging over N ranks makes the effective batch N times larger.

    Adasum combines gradients adaptively, so it only needs the local (NCCL) scaling, as
    Horovod documents; on CPU it needs none.
    """
    if adasum:
        return float(ctx.local_size) if nccl_built else 1.0
    return float(ctx.size) if scale_lr else 1.0


def warmup_factor(step: int, warmup_steps: int, scaler: float) -> float:
    """Multiplier on the scaled LR: ramps linearly from 1/scaler (the one-rank LR) to 1."""
    if warmup_steps <= 0 or scaler == 1.0 or step >= warmup_steps:
        return 1.0
    start = 1.0 / scaler
    return start + (1.0 - start) * step / warmup_steps


def make_optimizer(model: nn.Module, optim_cfg, hvd_cfg, ctx: Context, steps_per_epoch: int):
    """Build the optimizer, wrap it for Horovod, and return it with its warmup scheduler.

    The scheduler is stepped once per optimizer step (every `backward_passes_per_step` batches).
    """
    import horovod.torch as hvd

    if optim_cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optim.name {optim_cfg.name!r}: choose one of {', '.join(OPTIMIZERS)}")
    if hvd_cfg.backward_passes_per_step < 1:
        raise ValueError("horovod.backward_passes_per_step must be at least 1")
    scaler = lr_scaler(ctx, optim_cfg.scale_lr, hvd_cfg.adasum, hvd.nccl_built())
    optimizer = OPTIMIZERS[optim_cfg.name](model.parameters(), optim_cfg, optim_cfg.lr * scaler)
    # Horovod: average gradients across ranks with ring-allreduce, one fused allreduce per step.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if hvd_cfg.fp16_compression else hvd.Compression.none,
        backward_passes_per_step=hvd_cfg.backward_passes_per_step,
        op=hvd.Adasum if hvd_cfg.adasum else hvd.Average,
    )
    optimizer_steps = max(1, steps_per_epoch // hvd_cfg.backward_passes_per_step)
    warmup_steps = int(round(optim_cfg.warmup_epochs * optimizer_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_factor(step, warmup_steps, scaler))
    return optimizer, scheduler

