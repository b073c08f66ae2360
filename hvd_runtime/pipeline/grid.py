"""A rank's place in a pipeline: its stage and replica in the grid, its process sets, its neighbours.

The grid (world = replicas x stages, which rank holds which stage, which process sets exist) is
`hvd_runtime.parallel.dims.ParallelDims`, shared by every strategy; a replica's stages sit on
consecutive ranks, so the per-micro-batch activations stay inside a host while each stage's
once-per-step gradient allreduce (in its data-parallel process set) crosses hosts.

Framework-free: `hvd_runtime.torch.grid` and `hvd_runtime.tf.pipeline` initialise Horovod with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hvd_runtime.parallel.dims import ParallelConfigError, ParallelDims
from hvd_runtime.parallel.tensor_groups import TensorGroup
from hvd_runtime.parallel.world import process_set_of


class PipelineConfigError(ParallelConfigError):
    """A pipeline setting that does not fit: the schedule, the micro-batches, a stage's inputs."""


class Links(Protocol):
    """Links between neighbouring stages other than the socket link, which `init_pipeline` opens
    when given none (the generated projects' only link). bench/p2p_links.py holds Horovod's
    collectives as links, so that the benchmark and the tests can set them beside it.

    pairs: whether each neighbour pair needs a Horovod process set of its own, made at start-up.
    start(hvd): once Horovod runs, before the first link (a second communicator's rendezvous).
    link(rank, peer, process_set): this rank's link to `peer`; process_set is the pair's, or None
    when `pairs` is false.
    """

    pairs: bool

    def start(self, hvd) -> None: ...

    def link(self, rank: int, peer: int, process_set): ...


@dataclass
class PipelineRank:
    """This rank's place in the grid, with its process sets and links to its neighbours. Code that
    holds one calls it `place`; its `dims` is the whole grid's ParallelDims."""

    dims: ParallelDims
    rank: int
    dp_set: object = None                 # Horovod ProcessSet of this stage's replicas, None if alone
    tensor_group: object = None           # TensorGroup of this stage's tensor-parallel slices (tp > 1)
    prev: object = None                   # the link to the previous stage
    next: object = None                   # the link to the next stage
    chunks: int = 1                       # interleaved schedules: this rank's chunks of the model (virtual stages)
    _sets: dict = field(default_factory=dict, repr=False)

    @property
    def stages(self) -> int:
        return self.dims.pp

    @property
    def replicas(self) -> int:
        return self.dims.dp

    @property
    def stage(self) -> int:
        return self.dims.coords(self.rank).pp

    @property
    def replica(self) -> int:
        return self.dims.coords(self.rank).dp

    @property
    def prev_rank(self) -> int | None:
        """The rank holding the previous stage of this replica (and slice); None on the first stage.

        With chunks the stages form a ring: the first stage's chunk c + 1 follows the last's chunk c.
        """
        if self.is_first and self.chunks == 1:
            return None
        return self.dims.pp_ranks(self.rank)[(self.stage - 1) % self.stages]

    @property
    def next_rank(self) -> int | None:
        if self.is_last and self.chunks == 1:
            return None
        return self.dims.pp_ranks(self.rank)[(self.stage + 1) % self.stages]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def stage_root(self) -> int:
        """This stage's rank in replica 0: where its weights are broadcast from to the other replicas."""
        return self.dims.dp_ranks(self.rank)[0]

    @property
    def last_stage_root(self) -> int:
        """Rank that holds the loss of replica 0: where reports come from."""
        return self.dims.rank_of(dp=0, pp=self.stages - 1)

    def process_set(self, ranks: list[int]):
        return process_set_of(ranks, self.dims.world, self._sets)


def placed(dims: ParallelDims, rank: int, chunks: int, sets: dict) -> PipelineRank:
    """This rank's place in a started grid, with its stage's replicas' process set and its tensor
    group. sets: the process sets Horovod started with, by their ranks (a tuple)."""
    place = PipelineRank(dims=dims, rank=rank, chunks=chunks, _sets=sets)
    if dims.dp > 1:
        place.dp_set = place.process_set(dims.dp_ranks(rank))
    if dims.tp > 1:
        place.tensor_group = TensorGroup.of(dims, rank, sets)
    return place


def link_neighbours(place: PipelineRank, hvd, links: Links | None, tensor_link: type) -> None:
    """Link `place` to its neighbouring stages through `links`, or, when None, over a connection of
    each pair's own (hvd_runtime.pipeline.socket_link) that `tensor_link`, the framework's
    SocketTensorLink, carries its tensors over."""
    if links is None:
        from hvd_runtime.pipeline.socket_link import connect_neighbours

        neighbours = connect_neighbours(hvd, place.prev_rank, place.next_rank)
        place.prev, place.next = (tensor_link(link) if link else None for link in neighbours)
        return
    if place.prev_rank is None and place.next_rank is None:
        return
    links.start(hvd)
    for side, peer in (("prev", place.prev_rank), ("next", place.next_rank)):
        if peer is not None:
            pair = place.process_set(sorted([peer, place.rank])) if links.pairs else None
            setattr(place, side, links.link(place.rank, peer, pair))


def chunks_per_rank(parallel_cfg) -> int:
    """The model's chunks each rank holds: parallel.chunks for an interleaved schedule, else 1."""
    from hvd_runtime.config import INTERLEAVED

    return parallel_cfg.chunks if parallel_cfg.schedule in INTERLEAVED else 1


def check_chunks(stages: int, chunks: int, tp: int = 1) -> None:
    """Chunks per rank (interleaved schedules) need a ring of at least two stages, and whole stages."""
    if not isinstance(chunks, int) or chunks < 1:
        raise PipelineConfigError(f"chunks must be a positive integer, got {chunks!r} (e.g. 2)")
    if chunks > 1 and stages < 2:
        raise PipelineConfigError(f"{chunks} chunks per rank need at least 2 stages, got {stages}: "
                                  "set parallel.stages 2 or more, or use schedule 1f1b")
    if chunks > 1 and tp > 1:
        raise PipelineConfigError("the interleaved-1f1b schedule does not split stages over tensor-parallel ranks: "
                                  "use parallel.tp 1, or schedule 1f1b")


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """Sizes torch.tensor_split / numpy.array_split give: the first batch % m get one more sample."""
    if micro_batches > batch:
        raise PipelineConfigError(f"micro_batches {micro_batches} exceeds the batch size {batch}: "
                                  f"use micro_batches <= {batch}")
    q, r = divmod(batch, micro_batches)
    return [q + (i < r) for i in range(micro_batches)]
