"""ZeRO whatever the framework: which rows of a tensor each data-parallel rank owns, and the
refusal of the settings of a job it cannot run with.

Rows are dealt as Horovod's reduce-scatter deals a tensor's first dimension over N ranks (the first
`rows % N` ranks one row more), so the averaged rows a reduce-scatter hands a rank are the ones it
steps; a tensor with fewer rows than ranks is not cut.
"""

from __future__ import annotations

import os

from hvd_runtime.config import ConfigError

__all__ = ["is_cut", "refuse_misfits", "row_range"]


def row_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s rows of `rows`, as Horovod's reduce-scatter deals them out."""
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def is_cut(shape, size: int, dim: int = 0) -> bool:
    """Whether a tensor of `shape` is cut along `dim` over `size` ranks (each must get a row)."""
    return size > 1 and len(shape) > dim and shape[dim] >= size


def refuse_misfits(hvd_cfg, own: list[tuple[bool, str]]) -> None:
    """Refuse in one line (ConfigError) the first setting horovod.zero cannot serve: a framework's
    `own` (applies, what and its fix), then those no framework's ZeRO serves."""
    misfits = [
        *own,
        (os.environ.get("HOROVOD_ELASTIC") == "1", "an elastic job (a lost rank would take its rows with it): "
                                                  "run without --min-np/--max-np, or set horovod.zero 0"),
        (hvd_cfg.adasum, "horovod.adasum (Adasum reduces whole gradients): set one of them off"),
        (hvd_cfg.fp16_compression, "horovod.fp16_compression (reduce-scatter sends the gradients as they are): "
                                   "set it false"),
    ]
    for misfit, fix in misfits:
        if misfit:
            raise ConfigError(f"horovod.zero {hvd_cfg.zero} does not work with {fix}")
