"""Which ranks form a tensor-parallel group, and which average gradients together.

    layout = TensorLayout(world=4, tp=2)     # 2 tensor-parallel groups x 2 data-parallel replicas
    layout.tp_ranks(rank), layout.dp_ranks(rank), layout.process_set_ranks()
    ranks = init_tensor_parallel(hvd, tp=2)  # instead of hvd.init(): ranks.group, ranks.dp_set

A tensor-parallel group's ranks are consecutive, so horovodrun (which fills a host before the
next) keeps them on one host: they exchange activations in every layer, forward and backward,
while the data-parallel replicas only average gradients once a step. Horovod needs every process
set at `hvd.init`, so the layout lists them all beforehand; the whole world reuses Horovod's
global set.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvd_runtime.config import ConfigError
from hvd_runtime.parallel.world import check_factor, launched_world_size, process_set_of


class TensorParallelError(ConfigError):
    """A tensor-parallel size that does not fit the world or the layer being split."""


@dataclass(frozen=True)
class TensorLayout:
    """world = tp x dp, checked; rank r is member r % tp of tensor-parallel group r // tp."""

    world: int
    tp: int

    def __post_init__(self):
        check_factor(self.world, self.tp, "tp", "tp", TensorParallelError)

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def tp_rank(self, rank: int) -> int:
        """This rank's place within its tensor-parallel group: which slice of each split layer it holds."""
        return rank % self.tp

    def tp_ranks(self, rank: int) -> list[int]:
        first = rank - rank % self.tp
        return list(range(first, first + self.tp))

    def dp_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same slices: where this rank's gradients are averaged."""
        return list(range(rank % self.tp, self.world, self.tp))

    def process_set_ranks(self) -> list[list[int]]:
        """Every rank list that needs a process set of its own (neither alone nor the whole world)."""
        groups = [self.tp_ranks(g * self.tp) for g in range(self.dp)] + [self.dp_ranks(t) for t in range(self.tp)]
        return [r for r in groups if 1 < len(r) < self.world]


@dataclass(frozen=True)
class TensorGroup:
    """This rank's tensor-parallel group: its place in it, its size, and its Horovod process set."""

    rank: int
    size: int
    process_set: object

    @classmethod
    def of(cls, layout: TensorLayout, rank: int, process_sets: dict[tuple[int, ...], object]) -> "TensorGroup":
        """`process_sets`: the sets made at hvd.init for layout.process_set_ranks(), by their ranks."""
        return cls(layout.tp_rank(rank), layout.tp, process_set_of(layout.tp_ranks(rank), layout.world, process_sets))


@dataclass(frozen=True)
class TensorRanks:
    """What init_tensor_parallel gives a rank: the layout, its tensor group, its dp process set (None alone)."""

    layout: TensorLayout
    group: TensorGroup
    dp_set: object


def init_tensor_parallel(hvd, tp: int) -> TensorRanks:
    """hvd.init with every process set the layout needs; `hvd` is horovod.torch or horovod.tensorflow."""
    layout = TensorLayout(world=launched_world_size() or 1, tp=tp)
    wanted = layout.process_set_ranks()
    sets = [hvd.ProcessSet(r) for r in wanted]
    hvd.init(process_sets=sets)
    by_ranks = {tuple(r): s for r, s in zip(wanted, sets)}
    dp_ranks = layout.dp_ranks(hvd.rank())
    dp_set = None if len(dp_ranks) == 1 else process_set_of(dp_ranks, layout.world, by_ranks)
    return TensorRanks(layout, TensorGroup.of(layout, hvd.rank(), by_ranks), dp_set)


def check_block_splits(heads: int, dropout: float, tp: int) -> None:
    """What a transformer block needs to split over tp ranks, in either framework: one line if not."""
    if heads % tp:
        raise TensorParallelError(f"model.heads {heads} do not split over tp {tp}: choose a tp that divides {heads}")
    if dropout:
        raise TensorParallelError(f"model.dropout {dropout} with tensor parallelism: the group's ranks would drop "
                                  "different parts of the activations they share; set model.dropout 0")


def split_range(features: int, parts: int, index: int, what: str) -> slice:
    """The slice of `features` that part `index` of `parts` holds; one line if they do not divide."""
    if features % parts:
        raise TensorParallelError(f"{what} has {features} features, which do not split over tp {parts}: "
                                  f"choose a tp that divides {features}")
    size = features // parts
    return slice(index * size, (index + 1) * size)
