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
from hvd_runtime.parallel.tensor_groups import TensorGroup
from hvd_runtime.pipeline.grid import PipelineConfigError, PipelineRank, check_chunks
from hvd_runtime.parallel.world import grid_of, launched_world_size
from hvd_runtime.scaling import set_cycle_time
from hvd_runtime.torch.context import Context, init_horovod, pin_device

__all__ = ["Context", "ParallelDims", "PipelineConfigError", "PipelineRank", "init", "init_pipeline"]


def init(cfg, strategy: str) -> Context:
    """Start Horovod for the project's `strategy` as cfg.parallel and cfg.horovod lay it out: the
    context parallelize dispatches on (ctx.pipeline, ctx.tensor, ctx.stage_devices)."""
    return start(cfg, strategy, init_horovod, init_pipeline)


def init_pipeline(stages: int, seed: int = 0, threads_per_rank: int = 0, cycle_time_ms: float = 0.0,
                  p2p: str = "socket", tp: int = 1, chunks: int = 1) -> tuple[Context, PipelineRank]:
    """Initialise Horovod with the pipeline's process sets, pin the device, open the neighbour links.

    p2p: "socket" (a TCP connection per neighbour pair, the default, as for TensorFlow: fastest,
    see docs/pipeline.md), "torch" (torch.distributed gloo send/recv), "alltoall" or "broadcast"
    (Horovod collectives in 2-rank process sets).
    seed, threads_per_rank: as init_horovod's (seed + rank; on the CPU, cores / ranks on this host
    threads by default).
    cycle_time_ms: Horovod's background-loop period (hvd_runtime.scaling.set_cycle_time).
    tp: each stage split over this many ranks (tensor parallelism, `place.tensor_group`): the grid is
    replicas x stages x tp, and each slice talks to the same slice of the neighbouring stages.
    chunks: the model's chunks per rank, for the interleaved-1f1b schedule: the stages then form a
    ring, the last linked back to the first.
    """
    import horovod.torch as hvd
    import torch

    from hvd_runtime.pipeline.socket_link import connect_neighbours
    from hvd_runtime.torch.p2p import LINKS, SocketTensorLink, TorchDistLink, init_torch_distributed

    if p2p not in LINKS:
        raise PipelineConfigError(f"unknown p2p {p2p!r}: choose one of {', '.join(LINKS)} (e.g. 'socket')")
    check_chunks(stages, chunks, tp)
    world = launched_world_size() or (hvd.size() if hvd.is_initialized() else 1)
    dims = grid_of(hvd, world, tp=tp, pp=stages)
    wanted = dims.process_set_ranks(pairs=p2p in ("alltoall", "broadcast"), ring=chunks > 1)
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
    place = PipelineRank(dims=dims, rank=hvd.rank(), p2p=p2p, chunks=chunks,
                      _sets={tuple(r): s for r, s in zip(wanted, sets)})
    ctx = Context(pin_device(seed, threads_per_rank), pipeline=place)
    if dims.dp > 1:
        place.dp_set = place.process_set(dims.dp_ranks(place.rank))
    if dims.tp > 1:
        place.tensor_group = TensorGroup.of(dims, place.rank, place._sets)
    if p2p == "torch" and dims.pp > 1:
        init_torch_distributed()

    def link(peer: int, pair: list[int]):
        if p2p == "torch":
            return TorchDistLink(place.rank, peer)
        return LINKS[p2p](place.rank, peer, place.process_set(pair))

    if p2p == "socket":
        links = connect_neighbours(hvd, place.prev_rank, place.next_rank)
        place.prev, place.next = (SocketTensorLink(link) if link else None for link in links)
        return ctx, place
    if place.prev_rank is not None:
        place.prev = link(place.prev_rank, sorted([place.prev_rank, place.rank]))
    if place.next_rank is not None:
        place.next = link(place.next_rank, sorted([place.rank, place.next_rank]))
    return ctx, place
