"""Horovod's fusion buffer as the unit a step's collectives are grouped by.

A group of tensors larger than HOROVOD_FUSION_THRESHOLD bytes would not fuse into one collective,
so the step's grouped collectives (the CPU ranks' gradient allreduce, ZeRO's reduce-scatters and
all-gathers) each take at most one buffer's worth, in order.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

__all__ = ["DEFAULT_FUSION_THRESHOLD", "fusion_threshold", "in_fusion_buffers"]

T = TypeVar("T")

# Horovod's own default for HOROVOD_FUSION_THRESHOLD (bytes)
DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024


def fusion_threshold() -> int:
    """HOROVOD_FUSION_THRESHOLD as Horovod reads it (0 or unset: its default)."""
    return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)) or DEFAULT_FUSION_THRESHOLD


def in_fusion_buffers(items: list[T], nbytes: Callable[[T], int], limit: int | None = None) -> list[list[T]]:
    """`items` in order, in groups of at most one fusion buffer's bytes, or `limit` bytes (an item
    larger than that alone); no group for no item."""
    limit = fusion_threshold() if limit is None else limit
    groups: list[list[T]] = [[]]
    size = 0
    for item in items:
        n = nbytes(item)
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups if groups[0] else []
