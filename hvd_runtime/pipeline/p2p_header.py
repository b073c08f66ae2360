"""The header in front of a pipeline message, whatever the framework: dtype and shape as int64 words.

A receiver that does not know what is coming (an activation of a first micro-batch size) reads
it from these words: the dtype's index in the link's dtype list, the number of dims, then the
dims, padded to a fixed length so the header itself always has a known shape.
"""

from __future__ import annotations

from typing import Sequence

HEADER_WORDS = 10   # dtype code, ndim, up to 8 dims


def header_words(dtypes: Sequence, dtype, shape: Sequence[int]) -> list[int]:
    """The header's words for a tensor of `dtype` and `shape`; refuses what a message cannot carry."""
    if len(shape) > HEADER_WORDS - 2:
        raise ValueError(f"cannot send a tensor of {len(shape)} dims between stages: at most {HEADER_WORDS - 2}")
    if dtype not in dtypes:
        name = getattr(dtype, "name", str(dtype))
        raise ValueError(f"cannot send {name} between stages: use one of "
                         f"{', '.join(getattr(d, 'name', str(d)) for d in dtypes)}")
    return [list(dtypes).index(dtype), len(shape), *shape] + [0] * (HEADER_WORDS - 2 - len(shape))


def read_header_words(dtypes: Sequence, words: Sequence[int]) -> tuple[object, tuple[int, ...]]:
    """(dtype, shape) from a header's words."""
    return dtypes[words[0]], tuple(words[2:2 + words[1]])
