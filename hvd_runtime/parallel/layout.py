"""What Horovod starts with for each strategy, as cfg.parallel lays it out: the one place a strategy is chosen.

    ctx = init(cfg, "tensor")     # hvd_runtime.{torch,tf}.grid.init: start(cfg, strategy, init_horovod, init_pipeline)

A generated train.py names its project's strategy once, here; from then on the context says
what the job is (ctx.pipeline, ctx.tensor, ctx.stage_devices) and parallelize, the checkpoints
and the loop dispatch on that:

| strategy | started with |
|---|---|
| data | init_horovod: every rank a replica |
| model-split | init_horovod(devices_per_rank=parallel.stages): this rank's devices, one per stage |
| tensor | init_horovod(tp=parallel.tp): tp groups x replicas |
| pipeline | init_pipeline(parallel.stages, tp=parallel.tp, chunks): replicas x stages x tp, the neighbours linked |

Framework-free: each framework hands in its own init_horovod and init_pipeline.
"""

from __future__ import annotations

from typing import Callable

from hvd_runtime import preemption, watchdog
from hvd_runtime.config import ConfigError
from hvd_runtime.pipeline.grid import chunks_per_rank

__all__ = ["STRATEGIES", "start"]

STRATEGIES = ("data", "model-split", "tensor", "pipeline")


def start(cfg, strategy: str, init_horovod: Callable, init_pipeline: Callable):
    """Horovod started for `strategy` with cfg's seed, threads and cycle time, the hang watchdog
    armed (hvd_runtime.watchdog) and the stop signals noted (hvd_runtime.preemption): the Context."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    # before hvd.init, which reads Horovod's stall-warning period; start-up has the longer allowance
    watchdog.start(cfg.train)
    preemption.install(cfg.train.grace_s)   # SIGTERM, SIGUSR1: stop after a step every rank agrees on
    horovod, parallel = cfg.horovod, cfg.parallel
    common = {"seed": cfg.seed, "threads_per_rank": horovod.threads_per_rank, "cycle_time_ms": horovod.cycle_time_ms}
    if strategy == "pipeline":
        ctx, _ = init_pipeline(parallel.stages, tp=parallel.tp, chunks=chunks_per_rank(parallel), **common)
        return ctx
    layout = {"data": {}, "model-split": {"devices_per_rank": parallel.stages}, "tensor": {"tp": parallel.tp}}
    return init_horovod(**common, **layout[strategy])
