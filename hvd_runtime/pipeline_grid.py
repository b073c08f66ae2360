"""The pipeline rank grid: pp stages x dp replicas, and the Horovod process sets it needs.

Rank r holds stage r % stages of replica r // stages. A replica's stages sit on consecutive ranks,
so horovodrun (which fills a host before the next) keeps the per-micro-batch activation traffic
inside a host, while the once-per-step gradient allreduce of a stage crosses hosts.

Process sets, all created at `hvd.init` (Horovod requires every rank to declare the same ones,
unless HOROVOD_DYNAMIC_PROCESS_SETS=1 lets `hvd.add_process_set` add them later):
- one per stage with its dp replicas: each stage's gradients are averaged there;
- one per neighbour pair of a replica, when the Horovod collectives carry the p2p messages.

Framework-free: `hvd_runtime.torch.grid` and `hvd_runtime.tf.pipeline` initialise Horovod with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hvd_runtime.config import ConfigError
from hvd_runtime.parallel.world import check_factor, process_set_of


class PipelineConfigError(ConfigError):
    """The world size and the stage count do not fit together (-np against `parallel.stages`)."""


@dataclass(frozen=True)
class PipelineDims:
    """world = stages x replicas, checked; pure arithmetic, no Horovod."""

    world: int
    stages: int

    def __post_init__(self):
        check_factor(self.world, self.stages, "stages", "--stages", PipelineConfigError)

    @property
    def replicas(self) -> int:
        return self.world // self.stages

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of a global rank."""
        return rank % self.stages, rank // self.stages

    def stage_ranks(self, stage: int) -> list[int]:
        """The dp replicas of one stage: its gradient-averaging group."""
        return [self.rank_of(stage, d) for d in range(self.replicas)]

    def pair_ranks(self, stage: int, replica: int) -> list[int]:
        """Stage `stage` and `stage + 1` of one replica: a p2p pair."""
        return [self.rank_of(stage, replica), self.rank_of(stage + 1, replica)]

    def process_set_ranks(self, pairs: bool) -> list[list[int]]:
        """Every rank list that needs its own process set (the whole world reuses the global set)."""
        sets = [self.stage_ranks(s) for s in range(self.stages)] if self.replicas > 1 else []
        if pairs:
            sets += [self.pair_ranks(s, d) for d in range(self.replicas) for s in range(self.stages - 1)]
        return [r for r in sets if 1 < len(r) < self.world]

    def describe(self) -> str:
        return f"{self.world} ranks = {self.stages} stages x {self.replicas} replicas"


@dataclass
class PipelineRank:
    """This rank's place in the grid, with its process sets and links to its neighbours."""

    dims: PipelineDims
    rank: int
    p2p: str
    dp_set: object = None                 # Horovod ProcessSet of this stage's replicas, None if alone
    prev: object = None                   # p2p Link to the previous stage
    next: object = None                   # p2p Link to the next stage
    _sets: dict = field(default_factory=dict, repr=False)

    @property
    def stages(self) -> int:
        return self.dims.stages

    @property
    def replicas(self) -> int:
        return self.dims.replicas

    @property
    def stage(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def replica(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def last_stage_root(self) -> int:
        """Rank that holds the loss of replica 0: where reports come from."""
        return self.dims.rank_of(self.stages - 1, 0)

    def process_set(self, ranks: list[int]):
        return process_set_of(ranks, self.dims.world, self._sets)


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """Sizes torch.tensor_split / numpy.array_split give: the first batch % m get one more sample."""
    if micro_batches > batch:
        raise PipelineConfigError(f"micro_batches {micro_batches} exceeds the batch size {batch}: "
                                  f"use micro_batches <= {batch}")
    q, r = divmod(batch, micro_batches)
    return [q + (i < r) for i in range(micro_batches)]
