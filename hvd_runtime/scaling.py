"""How a job's size changes the work of each rank: CPU threads, Horovod's cycle, the learning rate.

Framework-free: the torch and TF runtimes both call these, so both scale the same way.
"""

from __future__ import annotations

import ipaddress
import os


def ranks_on_this_machine(local_size: int, size: int) -> int:
    """The job's ranks that share this machine's cores: Horovod's local size, unless this rank's
    host is a loopback name (localhost, 127.0.0.1, ::1), where it is every rank of the job.

    Horovod counts local ranks by host name. A job that names this machine twice, as an elastic
    project's discover_hosts.sh does by default (localhost:1 and 127.0.0.1:1, so that a failed worker
    blacklists one name, not the machine), has a local size of 1 under each name: each rank took
    every core, twice the threads there are cores. Loopback names are only ever this machine, and
    hvdgen's launch lines name either only this machine or only hosts by their own names; a job
    that mixes both runs its loopback ranks on fewer threads, never more."""
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    return max(local_size, size) if _is_loopback(host) else local_size


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cpu_threads(local_size: int, requested: int = 0) -> int:
    """Cores shared evenly by the ranks on this host: oversubscribed threads slow every rank."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_size))


# Horovod's cycle on CPU ranks, as measured by bench/cycle_time_bench.py (docs/benchmarks-cycle-time.md).
CPU_CYCLE_TIME_MS = 5.0
# With the wake-up (below) the cycle is only the longest idle wait: work does not wait for it.
WAKING_CPU_CYCLE_TIME_MS = 100.0
# ... except where some ranks' loops idle while others' need a collective (set_cycle_time's `staggered`).
STAGGERED_CPU_CYCLE_TIME_MS = CPU_CYCLE_TIME_MS


def horovod_wakes_on_enqueue() -> bool:
    """True for the Horovod hvdgen builds: its background loop can wake when a tensor is queued
    (HOROVOD_WAKE_ON_ENQUEUE, hvdgen.build.patches). Another Horovod sleeps whole cycles."""
    try:
        from horovod.common import basics
    except ImportError:
        return False
    return bool(getattr(basics, "WAKES_ON_ENQUEUE", False))


def set_cycle_time(cycle_time_ms: float, gpu: bool, staggered: bool = False) -> None:
    """Horovod's background loop wakes every HOROVOD_CYCLE_TIME ms to negotiate and launch
    collectives, idle or not, and each negotiation is a collective of every rank's loop. Read at
    hvd.init, so this must come first. Explicit HOROVOD_* settings in the environment win.

    With GPUs: Horovod's own 1 ms (0 here); the loop runs on cores the training does not use.
    (Woken on enqueue instead, one H100 rank trained ResNet-18 at the same speed: docs/gpu.md.)

    On CPU ranks the loop's thread shares the cores with the training threads. Where Horovod
    wakes on enqueue (hvdgen's build), the loop sleeps until a tensor is queued, so a step's
    allreduce starts at once and idle cycles stop waking every rank; the cycle is then only the
    longest idle wait (WAKING_CPU_CYCLE_TIME_MS by default). With the step's gradients in one
    grouped allreduce (hvd_runtime.torch.optim.gradient_groups; TF's step already groups them),
    that keeps a CPU job about as fast as torch DDP (docs/horovod-on-cpu.md). Without the
    wake-up, CPU_CYCLE_TIME_MS: fewer, fuller negotiations per step than at 1 ms
    (docs/benchmarks-cycle-time.md).

    staggered: ranks queue collectives while other ranks' loops have nothing queued (the
    tensor-parallel stages of a pipeline: one stage's groups reduce while the next stage waits for
    its activations). Every cycle of a loop is a collective of all ranks in each of its process
    sets, the global one included, so a loop sleeping its idle wait holds up every other rank's
    next collective until it wakes. Such jobs wake their idle loops every
    STAGGERED_CPU_CYCLE_TIME_MS, short enough that those waits no longer make up most of a step
    (docs/horovod-on-cpu.md).
    """
    if gpu:
        if cycle_time_ms > 0:
            os.environ.setdefault("HOROVOD_CYCLE_TIME", f"{cycle_time_ms:g}")
        return
    waking = horovod_wakes_on_enqueue() and os.environ.get("HOROVOD_WAKE_ON_ENQUEUE", "1") not in ("", "0")
    if waking:
        os.environ.setdefault("HOROVOD_WAKE_ON_ENQUEUE", "1")
    if cycle_time_ms <= 0:
        if staggered:
            cycle_time_ms = STAGGERED_CPU_CYCLE_TIME_MS
        else:
            cycle_time_ms = WAKING_CPU_CYCLE_TIME_MS if waking else CPU_CYCLE_TIME_MS
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
