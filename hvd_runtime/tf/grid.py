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
from hvd_runtime.parallel.tensor_groups import TensorGroup
from hvd_runtime.parallel.world import grid_of, launched_world_size
from hvd_runtime.pipeline.grid import PipelineConfigError, PipelineRank, check_chunks
from hvd_runtime.tf.context import Context, init_horovod

__all__ = ["P2P_LINKS", "init", "init_pipeline"]


def init(cfg, strategy: str) -> Context:
    """Start Horovod for the project's `strategy` as cfg.parallel and cfg.horovod lay it out: the
    context parallelize dispatches on (ctx.pipeline, ctx.tensor, ctx.stage_devices)."""
    return start(cfg, strategy, init_horovod, init_pipeline)


P2P_LINKS = ("socket", "alltoall")


def init_pipeline(stages: int, seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0,
                  p2p: str = "socket", tp: int = 1, chunks: int = 1) -> tuple[Context, PipelineRank]:
    """Initialise Horovod with the grid's process sets (dp per stage; neighbour pairs for alltoall) and link neighbours.

    p2p: "socket" (a TCP connection per neighbour pair, the default: fastest, see docs/pipeline.md)
    or "alltoall" (Horovod's alltoall in the pair's process set: nothing beside Horovod).
    tp: each stage split over this many ranks (tensor parallelism, `place.tensor_group`, slice_stage):
    the grid is replicas x stages x tp, and each slice talks to the same slice of the neighbours.
    chunks: the model's chunks per rank (interleaved-1f1b): the stages then link in a ring.
    """
    import horovod.tensorflow as hvd

    from hvd_runtime.pipeline.socket_link import connect_neighbours
    from hvd_runtime.tf.p2p import AlltoallLink, SocketTensorLink

    if p2p not in P2P_LINKS:
        raise PipelineConfigError(f"unknown p2p {p2p!r}: choose one of {', '.join(P2P_LINKS)} (e.g. 'socket')")
    check_chunks(stages, chunks, tp)
    world = launched_world_size() or 1
    dims = grid_of(hvd, world, tp=tp, pp=stages)
    wanted = dims.process_set_ranks(pairs=p2p == "alltoall", ring=chunks > 1)
    sets = [hvd.ProcessSet(r) for r in wanted]
    ctx = init_horovod(seed, threads_per_rank, cycle_time_ms, process_sets=sets, staggered=dims.staggered)
    if ctx.size != dims.world:
        raise PipelineConfigError(f"Horovod started {ctx.size} ranks but the launcher said {world}: "
                                  "launch with horovodrun")
    place = PipelineRank(dims=dims, rank=ctx.rank, p2p=p2p, chunks=chunks, _sets={tuple(r): s for r, s in zip(wanted, sets)})
    if dims.dp > 1:
        place.dp_set = place.process_set(dims.dp_ranks(place.rank))
    if dims.tp > 1:
        place.tensor_group = TensorGroup.of(dims, place.rank, place._sets)
    prev, next_ = place.prev_rank, place.next_rank
    if p2p == "socket":
        links = connect_neighbours(hvd, prev, next_)
        place.prev, place.next = (SocketTensorLink(link) if link else None for link in links)
    else:
        if prev is not None:
            place.prev = AlltoallLink(place.rank, prev, place.process_set(sorted([prev, place.rank])))
        if next_ is not None:
            place.next = AlltoallLink(place.rank, next_, place.process_set(sorted([place.rank, next_])))
    return replace(ctx, pipeline=place), place
