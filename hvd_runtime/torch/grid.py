"""Horovod started with the rank grid on PyTorch: every strategy's start-up, a pipeline's process sets and links.

    ctx = init(cfg, "pipeline")           # data | model-split | tensor | pipeline, as cfg.parallel lays it out
    ctx, place = init_pipeline(stages=2)   # a pipeline's start, by hand: process sets are fixed at init
    place.stage, place.replica, place.is_first, place.is_last
    ctx.device, ctx.data_rank, ctx.data_size   # this rank's device; its replica, of how many

The grid itself (which rank holds which stage, which process sets exist) is framework-free, in
`hvd_runtime.parallel.dims`; this rank's place in it in `hvd_runtime.pipeline.grid`; what each
strategy starts with in `hvd_runtime.parallel.layout`.
"""

from __future__ import annotations

import os

from hvd_runtime.parallel.dims import ParallelDims
from hvd_runtime.parallel.layout import start
from hvd_runtime.pipeline.grid import Links, PipelineConfigError, PipelineRank, check_chunks, link_neighbours, placed
from hvd_runtime.parallel.world import grid_of, launched_world_size
from hvd_runtime.scaling import set_cycle_time
from hvd_runtime.torch.context import Context, init_horovod, pin_device

__all__ = ["Context", "ParallelDims", "PipelineConfigError", "PipelineRank", "init", "init_pipeline"]


def init(cfg, strategy: str) -> Context:
    """Start Horovod for the project's `strategy` as cfg.parallel and cfg.horovod lay it out: the
    context parallelize dispatches on (ctx.pipeline, ctx.tensor, ctx.stage_devices)."""
    return start(cfg, strategy, init_horovod, init_pipeline)


def init_pipeline(stages: int, seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0,
                  tp: int = 1, chunks: int = 1, links: Links | None = None) -> tuple[Context, PipelineRank]:
    """Initialise Horovod with the pipeline's process sets, pin the device, open the neighbour links.

    seed, threads_per_rank: as init_horovod's (seed + rank; on the CPU, cores / ranks on this host
    threads by default).
    cycle_time_ms: Horovod's background-loop period (hvd_runtime.scaling.set_cycle_time).
    tp: each stage split over this many ranks (tensor parallelism, `place.tensor_group`): the grid is
    replicas x stages x tp, and each slice talks to the same slice of the neighbouring stages.
    chunks: the model's chunks per rank, for the interleaved-1f1b schedule: the stages then form a
    ring, the last linked back to the first.
    links: how neighbours exchange messages (hvd_runtime.pipeline.grid.Links); None, the default,
    is a connection of each pair's own (hvd_runtime.pipeline.socket_link), see docs/pipeline.md.
    """
    import horovod.torch as hvd
    import torch

    from hvd_runtime.torch.p2p import SocketTensorLink

    check_chunks(stages, chunks, tp)
    world = launched_world_size() or (hvd.size() if hvd.is_initialized() else 1)
    dims = grid_of(hvd, world, tp=tp, pp=stages)
    wanted = dims.process_set_ranks(pairs=links is not None and links.pairs, ring=chunks > 1)
    if hvd.is_initialized():
        if wanted and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
            raise PipelineConfigError("Horovod is already initialised: call init_pipeline() instead of hvd.init(), "
                                      "or set HOROVOD_DYNAMIC_PROCESS_SETS=1")
        sets = [hvd.add_process_set(r) for r in wanted]
    else:
        sets = [hvd.ProcessSet(r) for r in wanted]
        set_cycle_time(cycle_time_ms, gpu=torch.cuda.is_available(), staggered=dims.staggered)
        hvd.init(process_sets=sets)
    if hvd.size() != dims.world:
        dims = ParallelDims(world=hvd.size(), tp=tp, pp=stages)
    place = placed(dims, hvd.rank(), chunks, {tuple(r): s for r, s in zip(wanted, sets)})
    ctx = Context(pin_device(seed, threads_per_rank), pipeline=place)
    link_neighbours(place, hvd, links, SocketTensorLink)
    return ctx, place
