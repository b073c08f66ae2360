"""Which rows of a tensor each data-parallel rank owns under ZeRO, whatever the framework.

Rows are dealt as Horovod's reduce-scatter deals a tensor's first dimension over N ranks (the first
`rows % N` ranks one row more), so the averaged rows a reduce-scatter hands a rank are the ones it
steps; a tensor with fewer rows than ranks is not cut.
"""

from __future__ import annotations

__all__ = ["is_cut", "row_range"]


def row_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s rows of `rows`, as Horovod's reduce-scatter deals them out."""
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def is_cut(shape, size: int, dim: int = 0) -> bool:
    """Whether a tensor of `shape` is cut along `dim` over `size` ranks (each must get a row)."""
    return size > 1 and len(shape) > dim and shape[dim] >= size
