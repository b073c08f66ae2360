"""Progress for rank 0 that reads well both in a terminal and in horovodrun's piped output.

Under horovodrun a rank's stderr is a pipe, where tqdm's carriage-return redraws pile up into
one endless line. There we print a fresh line at most every `interval` seconds instead.
"""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")


class _LineStream:
    """Turns tqdm's '\\r'-redraws into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.strip("\r\n")
        if text.strip():  # tqdm clears its line with spaces on close
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress(items: Iterable[T], *, enabled: bool, desc: str, total: int | None = None,
             interval: float = 10.0) -> Iterator[T] | tqdm:
    """tqdm on rank 0 (`enabled`), silent elsewhere."""
    if not enabled:
        return iter(items)
    if sys.stderr.isatty():
        return tqdm(items, desc=desc, total=total, leave=False, dynamic_ncols=True)
    return tqdm(items, desc=desc, total=total, file=_LineStream(sys.stderr), mininterval=interval,
                maxinterval=interval, delay=interval, ncols=100, leave=False)
