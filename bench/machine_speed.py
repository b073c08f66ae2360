"""How fast this machine is right now, in three figures that do not depend on what is benchmarked.

The reports used to describe the machine by its load average alone. That says how busy the
cores are, not how fast they are: on a shared host the same machine measured `hvdgen --help` at
52 ms one day and 154 ms on another (2026-11-28), with a load average of 0.4 at the start of the
slow run, and the figures of that run came out 1.5 to 3.2 times slower. A report's figures can
only be compared with another day's beside a reference that moves with the machine and not with
the code:

- a one-thread 512x512 fp32 matrix product (BLAS: what large layers cost),
- a million-step Python loop (the interpreter: what small steps, messages and schedules cost), and
- the same products in two processes at once, each against one alone: on a shared host two
  busy processes need not get two cores' worth (the same day, a 2-stage pipeline that had run
  1.5x one process ran at 0.66-1.3x), and no np=2 figure can scale past what this allows.

Each is taken from the fastest of a few runs, since other jobs only ever add time: it estimates
what the machine can do, where the load average says how much of it the benchmark got. Even so
the figures move from minute to minute on a shared host (the matmul 37-82 GFLOP/s within ten
minutes here): read them as the state of the machine when the report began.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

MATMUL_SIZE = 512
LOOP_STEPS = 1_000_000


def best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` calls of run(), in seconds: other jobs only ever add time."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _python_loop() -> int:
    total = 0
    for i in range(LOOP_STEPS):
        total += i
    return total


def _product_worker(count: int, conn) -> None:
    """One process of the pair: on each go, `count` one-thread products; sends back their seconds."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    a @ a
    while conn.recv():
        started = time.perf_counter()
        for _ in range(count):
            a @ a
        conn.send(time.perf_counter() - started)


def matmul_speeds(count: int = 300, rounds: int = 3) -> tuple[float, float]:
    """(GFLOP/s of one process alone, the share of that speed each of two gets when both compute at once).

    Two spawned processes (one thread each, no thread pool inherited) each run alone, then both at
    once, `rounds` times; both figures come from the fastest runs. The products run there, not
    here: the process that writes a report keeps its own thread settings.
    """
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(2)]
    workers = [context.Process(target=_product_worker, args=(count, child)) for _, child in pipes]
    for worker in workers:
        worker.start()
    ends = [parent for parent, _ in pipes]
    alone, together = [], []
    try:
        for _ in range(rounds):
            for end in ends:
                end.send(True)
                alone.append(end.recv())
            for end in ends:
                end.send(True)
            together.append(statistics.mean(end.recv() for end in ends))
    finally:
        for end in ends:
            end.send(False)
        for worker in workers:
            worker.join()
    return 2 * MATMUL_SIZE ** 3 * count / min(alone) / 1e9, min(alone) / min(together)


def described() -> str:
    """The reference as a report's machine line says it."""
    gflops, share = matmul_speeds()
    loop_ms = best_seconds(_python_loop, repeats=5) * 1000
    return (f"speed reference {gflops:.1f} GFLOP/s (one thread, {MATMUL_SIZE}x{MATMUL_SIZE} fp32 matmul) and "
            f"{loop_ms:.0f} ms (a million-step Python loop), best of a few runs; two processes at once each "
            f"ran the products at {share:.2f} of one alone (bench/machine_speed.py)")


if __name__ == "__main__":
    print(described())
