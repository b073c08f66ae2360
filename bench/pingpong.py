"""One-way message time between two ranks through a pipeline link, whatever the framework."""

from __future__ import annotations

import statistics
import time

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24]   # bytes


def iterations(nbytes: int, quick: bool) -> int:
    """Enough round trips for a stable median, fewer for large messages."""
    return max(5, min(100, (200 << 20) // (nbytes * 20))) // (4 if quick else 1)


def pingpong(link, x, rank: int, iters: int, shape_known: bool) -> float:
    """Median seconds per one-way message (half a round trip) over `iters` round trips after a warm-up.

    The median, not the mean: the machine is shared and a stray spike should not decide.
    """
    shape = tuple(x.shape) if shape_known else None
    dtype = x.dtype if shape_known else None
    times = []
    for _ in range(iters + 3):
        start = time.perf_counter()
        # tags repeat, as a pipeline's do from step to step (Horovod caches the negotiation by name)
        if rank == 0:
            link.send(x, "act", shape_known)
            link.recv("grad", shape, dtype)
        else:
            y = link.recv("act", shape, dtype)
            link.send(y, "grad", shape_known)
        link.wait_sends()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) / 2


def print_table(rows) -> None:
    """rows: (mechanism, 'header' or 'known', bytes, seconds one way)."""
    print("| mechanism | shape | message | one-way latency | throughput |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, kind, nbytes, t in rows:
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        print(f"| {name} | {kind} | {size} | {t * 1e6:,.0f} µs | {nbytes / t / 1e6:,.0f} MB/s |")
