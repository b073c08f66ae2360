"""The collectives ZeRO chooses between on this machine, one 100 MB tensor each.

    horovodrun -np 2 -H localhost:2 --gloo python bench/zero_collectives.py

Rank 0 prints the mean of 5 calls of each: an allreduce (plain data parallelism), Horovod's
reduce-scatter, an all-to-all, the all-to-all with the local sum that makes it a reduce-scatter
(hvd_runtime.torch.zero's path for CPU tensors), and the all-gather of one rank's rows.
"""

import time

import horovod.torch as hvd
import torch


def timed(name: str, call, reps: int = 5) -> None:
    call()
    hvd.allreduce(torch.zeros(1), name=f"sync.{name}")
    start = time.perf_counter()
    for _ in range(reps):
        call()
    if hvd.rank() == 0:
        print(f"{name:14s} {(time.perf_counter() - start) / reps:.3f} s", flush=True)


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    n, size = 25_000_000, hvd.size()   # 100 MB of float32
    x = torch.randn(n)
    timed("allreduce", lambda: hvd.allreduce(x, op=hvd.Average, name="ar"))
    timed("reducescatter", lambda: hvd.reducescatter(x, op=hvd.Average, name="rs"))
    timed("alltoall", lambda: hvd.alltoall(x, name="a2a"))
    timed("alltoall+sum", lambda: hvd.alltoall(x, name="a2a.sum").view(size, -1).sum(0).div_(size))
    timed("allgather", lambda: hvd.allgather(x[: n // size], name="ag"))


if __name__ == "__main__":
    main()
