"""A rank's tensor-parallel group, its data-parallel process set, and the checks a split layer needs.

    ranks = init_tensor_parallel(hvd, tp=2)  # instead of hvd.init(): ranks.dims, ranks.group, ranks.dp_set
    ranks.group.rank, ranks.group.size       # which slice of each split layer this rank holds, of how many

The layout (tp groups of consecutive ranks, so on one host; dp groups across them) is
`hvd_runtime.parallel.dims.ParallelDims`, shared with the pipeline; Horovod needs every process
set at `hvd.init`, so init_tensor_parallel makes them all there.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvd_runtime.parallel.dims import ParallelConfigError, ParallelDims
from hvd_runtime.parallel.world import grid_of, launched_world_size, process_set_of


class TensorParallelError(ParallelConfigError):
    """A tensor-parallel size that does not fit the layer being split."""


@dataclass(frozen=True)
class TensorGroup:
    """This rank's tensor-parallel group: its place in it, its size, and its Horovod process set."""

    rank: int
    size: int
    process_set: object

    @classmethod
    def of(cls, dims: ParallelDims, rank: int, process_sets: dict[tuple[int, ...], object]) -> "TensorGroup":
        """`process_sets`: the sets made at hvd.init for dims.process_set_ranks(), by their ranks."""
        return cls(dims.coords(rank).tp, dims.tp, process_set_of(dims.tp_ranks(rank), dims.world, process_sets))


@dataclass(frozen=True)
class TensorRanks:
    """What init_tensor_parallel gives a rank: the grid, its tensor group, its dp process set (None alone)."""

    dims: ParallelDims
    group: TensorGroup
    dp_set: object


def init_tensor_parallel(hvd, tp: int) -> TensorRanks:
    """hvd.init with every process set the grid needs; `hvd` is horovod.torch or horovod.tensorflow."""
    dims = grid_of(hvd, launched_world_size() or 1, tp=tp)
    wanted = dims.process_set_ranks()
    sets = [hvd.ProcessSet(r) for r in wanted]
    hvd.init(process_sets=sets)
    by_ranks = {tuple(r): s for r, s in zip(wanted, sets)}
    dp_set = process_set_of(dims.dp_ranks(hvd.rank()), dims.world, by_ranks)
    return TensorRanks(dims, TensorGroup.of(dims, hvd.rank(), by_ranks), dp_set)


@dataclass(frozen=True)
class VocabularyShare:
    """The vocabulary rows of the logits this rank holds: all of them (no group, or tp 1), or its
    `vocab_range` of a head split by tensor parallelism. Each framework's loss and accuracy
    (hvd_runtime.{torch,tf}.vocab_parallel.VocabObjective) build on it."""

    group: TensorGroup | None
    vocab: int

    @classmethod
    def of(cls, group: TensorGroup | None, vocab: int):
        return cls(group if group is not None and group.size > 1 else None, vocab)

    @property
    def rows(self) -> slice:
        return vocab_range(self.vocab, self.group.size, self.group.rank) if self.group else slice(0, self.vocab)


def check_block_splits(heads: int, dropout: float, tp: int) -> None:
    """What a transformer block needs to split over tp ranks, in either framework: one line if not."""
    if heads % tp:
        raise TensorParallelError(f"model.heads {heads} do not split over tp {tp}: choose a tp that divides {heads}")
    check_no_dropout(dropout)


def check_no_dropout(dropout: float) -> None:
    """Dropout after a sum over the group would drop different parts on ranks that must agree."""
    if dropout:
        raise TensorParallelError(f"model.dropout {dropout} with tensor parallelism: the group's ranks would drop "
                                  "different parts of the activations they share; set model.dropout 0")


def vocab_range(vocab: int, parts: int, index: int) -> slice:
    """The token ids part `index` of `parts` holds of a vocabulary split over a tensor-parallel group.

    Vocabularies rarely divide (50257 for GPT-2's), so the parts may differ by one row: the first
    `vocab % parts` hold one more. Megatron pads the vocabulary instead, which changes the model's
    output; unequal slices keep it, at the price of unequal allgathers when a checkpoint is written.
    """
    if vocab < parts:
        raise TensorParallelError(f"a vocabulary of {vocab} tokens does not split over tp {parts}: "
                                  f"choose a tp of at most {vocab}")
    size, extra = divmod(vocab, parts)
    start = index * size + min(index, extra)
    return slice(start, start + size + (index < extra))


def slice_range(features: int, parts: int, index: int, what: str) -> slice:
    """The slice of `features` that part `index` of `parts` holds; one line if they do not divide."""
    if features % parts:
        raise TensorParallelError(f"{what} has {features} features, which do not split over tp {parts}: "
                                  f"choose a tp that divides {features}")
    size = features // parts
    return slice(index * size, (index + 1) * size)
