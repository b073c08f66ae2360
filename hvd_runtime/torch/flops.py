"""A torch run's model FLOPs and its devices' peak (hvd_runtime.mfu), counted by rank 0 at start-up.

The FLOPs of a forward are torch.utils.flop_counter's (matmuls, convolutions, attention) on meta
tensors: the model as build_on_meta made it, so counting costs no arithmetic and no memory.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hvd_runtime.mfu import Utilization, counted, gpu_peak, measured_rate, precision_column
from hvd_runtime.torch.memory_plan import held_parameters
from hvd_runtime.torch.meta_init import is_meta

__all__ = ["count_utilization", "forward_flops"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def forward_flops(model: nn.Module, sample_shape: tuple[int, ...], dtype: torch.dtype) -> float:
    """FLOPs of one sample's forward through the meta `model` (inputs of `sample_shape` and
    `dtype`), in eval mode; two samples are counted (BatchNorm refuses one) and halved."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.empty((2, *sample_shape), dtype=dtype, device="meta"))
    finally:
        model.train(was_training)
    return counter.get_total_flops() / 2


def _device_peak(ctx, precision: str) -> tuple[float, str] | None:
    """(peak FLOP/s of one of this rank's devices, its name) at `precision`; None for an unknown GPU."""
    if ctx.device.type == "cuda":
        name = torch.cuda.get_device_name(ctx.device)
        column = precision_column(precision, torch.backends.cuda.matmul.allow_tf32)
        peak = gpu_peak(name, column)
        return None if peak is None else (peak, f"{name}, {column}")
    dtype, n = DTYPES.get(precision, torch.float32), 512
    a = b = torch.full((n, n), 0.5, dtype=dtype)   # the values do not matter; no RNG is drawn from
    rate = measured_rate(lambda: torch.mm(a, b), 2.0 * n**3)
    return rate, f"CPU at its measured {precision} matmul rate, {torch.get_num_threads()} threads"


def count_utilization(model: nn.Module, example: np.ndarray, ctx, cfg, language_model: bool) -> Utilization | None:
    """hvd_runtime.mfu.counted for the meta `model` on this rank's devices; None on the other ranks
    and for a model made real already. `example`: a batch of training inputs (shape, dtype)."""
    if not ctx.is_root or not is_meta(model):
        return None
    per_rank = ctx.stage_devices if ctx.stage_devices and ctx.device.type == "cuda" else 1
    return counted(cfg.model, language_model, lambda: held_parameters(model),
                   lambda: forward_flops(model, example.shape[1:], torch.from_numpy(example[:1]).dtype),
                   lambda: _device_peak(ctx, cfg.train.precision), ctx.size * per_rank)
