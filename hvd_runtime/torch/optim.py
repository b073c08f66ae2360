"""The optimizer side of data parallelism: scaled LR with warmup, Horovod's DistributedOptimizer."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from hvd_runtime.adasum import check_adasum
from hvd_runtime.scaling import lr_scaler, warmup_factor
from hvd_runtime.torch.context import Context
from hvd_runtime.torch.fusion import in_fusion_buffers
from hvd_runtime.torch.zero import ZeroOptimizer

OPTIMIZERS = {
    "sgd": lambda params, cfg, lr: torch.optim.SGD(params, lr=lr, momentum=cfg.momentum,
                                                   weight_decay=cfg.weight_decay),
    "adam": lambda params, cfg, lr: torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay),
    "adamw": lambda params, cfg, lr: torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay),
}


@dataclass(frozen=True)
class WarmupSchedule:
    """The LR as a pure function of the optimizer step and the current world size.

    Holding no state, it resumes exactly from a checkpoint's step, and rescales by itself when
    an elastic job changes size.
    """

    base_lr: float
    scale_lr: bool
    adasum: bool
    nccl_built: bool
    warmup_steps: int

    def lr(self, optimizer_step: int, size: int, local_size: int = 1) -> float:
        """`size`: ranks that average gradients (the world, or a pipeline's replicas)."""
        scaler = lr_scaler(size, local_size, self.scale_lr, self.adasum, self.nccl_built)
        return self.base_lr * scaler * warmup_factor(optimizer_step, self.warmup_steps, scaler)

    def apply(self, optimizer, optimizer_step: int, size: int, local_size: int = 1) -> None:
        lr = self.lr(optimizer_step, size, local_size)
        for group in optimizer.param_groups:
            group["lr"] = lr


def make_schedule(optim_cfg, hvd_cfg, steps_per_epoch: int) -> WarmupSchedule:
    import horovod.torch as hvd

    optimizer_steps = max(1, steps_per_epoch // hvd_cfg.backward_passes_per_step)
    return WarmupSchedule(optim_cfg.lr, optim_cfg.scale_lr, hvd_cfg.adasum, hvd.nccl_built(),
                          int(round(optim_cfg.warmup_epochs * optimizer_steps)))


def plain_optimizer(params, optim_cfg, lr: float):
    """The framework optimizer named in the config, before any Horovod wrapping."""
    if optim_cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optim.name {optim_cfg.name!r}: choose one of {', '.join(OPTIMIZERS)}")
    params = list(params)
    if not params:  # a pipeline stage without weights (a flatten, a pooling) still steps with the others
        params = [{"params": []}]
    return OPTIMIZERS[optim_cfg.name](params, optim_cfg, lr)


def gradient_groups(model: nn.Module, device: torch.device, adasum: bool) -> list[list[torch.Tensor]] | None:
    """On CPU ranks, the step's gradients as a few grouped allreduces; elsewhere None (one each).

    Why: a CPU rank's Horovod loop shares the cores with training, and every negotiation is a
    collective of all ranks' loops. Tensor by tensor, a step's gradients went out in several
    allreduces as backward produced them, each waking every rank mid-backward; as one group they
    go out once, when backward ends (the loop wakes on it: hvd_runtime.scaling.set_cycle_time).
    Groups hold at most one fusion buffer of gradients each, in the model's order. GPUs keep
    Horovod's overlap of allreduce with backward (its loop runs on cores the training leaves
    free), and Adasum its own per-tensor reduction. So do elastic jobs: given groups, Horovod's
    optimizer broadcasts the parameter order from rank 0 when it is built, and a worker that
    joins a running job builds it while the others wait in the state's sync: the job would hang.
    """
    if device.type != "cpu" or adasum or os.environ.get("HOROVOD_ELASTIC") == "1":
        return None
    return in_fusion_buffers([p for p in model.parameters() if p.requires_grad],
                             lambda p: p.numel() * p.element_size()) or None


def make_optimizer(model: nn.Module, optim_cfg, hvd_cfg, ctx: Context, steps_per_epoch: int, slices=None):
    """Build the optimizer, wrap it for Horovod, and return it with its LR schedule.

    Under tensor parallelism (ctx.tensor) gradients are averaged over the data-parallel process
    set only, and with a single replica the optimizer is left unwrapped: nothing to average.
    horovod.zero 1-3: the optimizer steps this rank's rows of each parameter, its state and (2, 3)
    its gradients sharded over the replicas (hvd_runtime.torch.zero); `slices`: tensor parallelism's
    SlicedParameters of `model`, whose slices ZeRO cuts along tensor parallelism's dimension.

    Raises ConfigError for horovod.adasum on a job without Adasum (Gloo): at start-up, not as
    a HorovodInternalError at the first step.
    """
    import horovod.torch as hvd

    if hvd_cfg.backward_passes_per_step < 1:
        raise ValueError("horovod.backward_passes_per_step must be at least 1")
    check_adasum(hvd_cfg.adasum, hvd)
    schedule = make_schedule(optim_cfg, hvd_cfg, steps_per_epoch)
    lr = schedule.lr(0, ctx.data_size, ctx.local_size)
    if hvd_cfg.zero and ctx.dp_set is not None:
        # Horovod: gradients reduce-scattered over the replicas, each rank steps its rows, rows all-gathered
        return ZeroOptimizer(model, lambda tensors: plain_optimizer(tensors, optim_cfg, lr), hvd_cfg.zero,
                             ctx.dp_set, ctx.data_rank, ctx.data_size, slices), schedule
    optimizer = plain_optimizer(model.parameters(), optim_cfg, lr)
    if ctx.dp_set is None:  # a lone tensor-parallel replica: nothing to average
        return optimizer, schedule
    # Horovod: average gradients across ranks with ring-allreduce, one fused allreduce per step.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if hvd_cfg.fp16_compression else hvd.Compression.none,
        backward_passes_per_step=hvd_cfg.backward_passes_per_step,
        op=hvd.Adasum if hvd_cfg.adasum else hvd.Average,
        process_set=ctx.dp_set,  # tensor parallel: the replicas holding the same slices
        # CPU: the step's gradients at once. Not across tensor-parallel replicas: given groups,
        # Horovod's optimizer broadcasts from rank 0 in the process set, which may not hold it.
        groups=gradient_groups(model, ctx.device, hvd_cfg.adasum) if ctx.dp_set is hvd.global_process_set else None,
    )
    return optimizer, schedule
