"""How a job's size changes the work of each rank: CPU threads, Horovod's cycle, the learning rate.

Framework-free: the torch and TF runtimes both call these, so both scale the same way.
"""

from __future__ import annotations

import os


def cpu_threads(local_size: int, requested: int = 0) -> int:
    """Cores shared evenly by the ranks on this host: oversubscribed threads slow every rank."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_size))


# Horovod's cycle on CPU ranks, as measured by bench/cycle_time_bench.py (docs/benchmarks-cycle-time.md).
CPU_CYCLE_TIME_MS = 5.0


def set_cycle_time(cycle_time_ms: float, gpu: bool) -> None:
    """Horovod's background loop wakes every HOROVOD_CYCLE_TIME ms to negotiate and launch
    collectives, idle or not; a step's allreduce waits for the next wake-up. Read at hvd.init, so
    this must come first. An explicit HOROVOD_CYCLE_TIME in the environment wins.

    0 picks by where the ranks compute. With GPUs, Horovod's own 1 ms: the loop runs on cores the
    training does not use. On CPU ranks the loop's thread competes with the training threads for
    the same cores, a negotiation across processes every ms, so CPU_CYCLE_TIME_MS: fewer, fuller
    negotiations per step. Measured at np=2 on 2 cores: ResNet-18 and GPT 1.01-1.24x as fast as
    at 1 ms (three runs), a large MLP 0.99-1.30x, a 4-stage pipeline (np=4) about twice as fast;
    a model whose step takes a few ms (a tiny MLP) about half as fast, its step waiting for the
    cycle (set cycle_time_ms: 1 there).
    """
    if cycle_time_ms <= 0:
        cycle_time_ms = 0.0 if gpu else CPU_CYCLE_TIME_MS
    if cycle_time_ms > 0:
        os.environ.setdefault("HOROVOD_CYCLE_TIME", f"{cycle_time_ms:g}")


def lr_scaler(size: int, local_size: int, scale_lr: bool, adasum: bool, gpu_allreduce: bool) -> float:
    """Why the LR grows: averaging over N ranks makes the effective batch N times larger.

    Adasum combines gradients adaptively, so it needs only the local (GPU) scaling, as Horovod
    documents; on CPU it needs none.
    """
    if adasum:
        return float(local_size) if gpu_allreduce else 1.0
    return float(size) if scale_lr else 1.0


def warmup_factor(step: int, warmup_steps: int, scaler: float) -> float:
    """Multiplier on the scaled LR: ramps linearly from 1/scaler (the one-rank LR) to 1.

    Starting at the full scaled LR from random weights often diverges (Goyal et al., 2017).
    """
    if warmup_steps <= 0 or scaler == 1.0 or step >= warmup_steps:
        return 1.0
    start = 1.0 / scaler
    return start + (1.0 - start) * step / warmup_steps
