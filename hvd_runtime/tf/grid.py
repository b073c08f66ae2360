"""Horovod started with the rank grid on TensorFlow: every strategy's start-up, a pipeline's process sets and links.

    ctx = init(cfg, "pipeline")          # data | model-split | tensor | pipeline, as cfg.parallel lays it out
    ctx, place = init_pipeline(stages=2)  # a pipeline's start, by hand: process sets are fixed at init

The grid itself (which rank holds which stage, which process sets exist) is framework-free, in
`hvd_runtime.parallel.dims`; this rank's place in it in `hvd_runtime.pipeline.grid`; what each
strategy starts with in `hvd_runtime.parallel.layout`.
"""

from __future__ import annotations

from dataclasses import replace

from hvd_runtime.parallel.layout import start
from hvd_runtime.parallel.world import grid_of, launched_world_size
from hvd_runtime.pipeline.grid import Links, PipelineConfigError, PipelineRank, check_chunks, link_neighbours, placed
from hvd_runtime.tf.context import Context, init_horovod

__all__ = ["init", "init_pipeline"]


def init(cfg, strategy: str) -> Context:
    """Start Horovod for the project's `strategy` as cfg.parallel and cfg.horovod lay it out: the
    context parallelize dispatches on (ctx.pipeline, ctx.tensor, ctx.stage_devices)."""
    return start(cfg, strategy, init_horovod, init_pipeline)


def init_pipeline(stages: int, seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0,
                  tp: int = 1, chunks: int = 1, links: Links | None = None) -> tuple[Context, PipelineRank]:
    """Initialise Horovod with the grid's process sets (dp per stage; neighbour pairs when `links` asks) and link neighbours.

    tp: each stage split over this many ranks (tensor parallelism, `place.tensor_group`, slice_stage):
    the grid is replicas x stages x tp, and each slice talks to the same slice of the neighbours.
    chunks: the model's chunks per rank (interleaved-1f1b): the stages then link in a ring.
    links: how neighbours exchange messages (hvd_runtime.pipeline.grid.Links); None, the default,
    is a connection of each pair's own (hvd_runtime.pipeline.socket_link), see docs/pipeline.md.
    """
    import horovod.tensorflow as hvd

    from hvd_runtime.tf.p2p import SocketTensorLink

    check_chunks(stages, chunks, tp)
    world = launched_world_size() or 1
    dims = grid_of(hvd, world, tp=tp, pp=stages)
    wanted = dims.process_set_ranks(pairs=links is not None and links.pairs, ring=chunks > 1)
    sets = [hvd.ProcessSet(r) for r in wanted]
    ctx = init_horovod(seed, threads_per_rank, cycle_time_ms, process_sets=sets, staggered=dims.staggered)
    if ctx.size != dims.world:
        raise PipelineConfigError(f"Horovod started {ctx.size} ranks but the launcher said {world}: "
                                  "launch with horovodrun")
    place = placed(dims, ctx.rank, chunks, {tuple(r): s for r, s in zip(wanted, sets)})
    link_neighbours(place, hvd, links, SocketTensorLink)
    return replace(ctx, pipeline=place), place
