"""Latency and throughput of the point-to-point candidates between two pipeline stages.

    horovodrun -np 2 -H localhost:2 --gloo python bench/p2p_bench.py [--quick]

Ping-pong between ranks 0 and 1 through each `hvd_runtime.torch.p2p` link, the same code the
pipeline runs: one-way time is half the round trip. "header" rows send a message whose shape the
receiver does not know (activations); "known" rows skip the header (gradients).
Rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import horovod.torch as hvd
import torch

from hvd_runtime.torch.p2p import AlltoallLink, BroadcastLink, TorchDistLink, init_torch_distributed

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24]   # bytes


def pingpong(link, nbytes: int, iters: int, shape_known: bool) -> float:
    """Median seconds per one-way message (half a round trip) over `iters` round trips after a warm-up.

    The median, not the mean: the machine is shared and a stray spike should not decide.
    """
    x = torch.randn(nbytes // 4)
    shape = (x.numel(),) if shape_known else None
    dtype = torch.float32 if shape_known else None
    me = hvd.rank()
    times = []
    for i in range(iters + 3):
        start = time.perf_counter()
        # tags repeat, as a pipeline's do from step to step (Horovod caches the negotiation by name)
        if me == 0:
            link.send(x, "act", shape_known)
            y = link.recv("grad", shape, dtype)
        else:
            y = link.recv("act", shape, dtype)
            link.send(y, "grad", shape_known)
        link.wait_sends()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) / 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if hvd.size() != 2:
        raise SystemExit(f"run with -np 2, got {hvd.size()} ranks")
    init_torch_distributed()
    me, peer = hvd.rank(), 1 - hvd.rank()
    links = {"hvd.alltoall": AlltoallLink(me, peer, hvd.global_process_set),
             "hvd.broadcast": BroadcastLink(me, peer, hvd.global_process_set),
             "torch.distributed": TorchDistLink(me, peer)}
    rows = []
    for nbytes in SIZES:
        iters = max(5, min(100, (200 << 20) // (nbytes * 20))) // (4 if args.quick else 1)
        for name, link in links.items():
            for known in ([False] if name == "hvd.alltoall" else [False, True]):
                t = pingpong(link, nbytes, iters, known)
                rows.append((name, "known" if known else "header", nbytes, t))
    hvd.barrier()
    if me == 0:
        print("| mechanism | shape | message | one-way latency | throughput |")
        print("| --- | --- | ---: | ---: | ---: |")
        for name, kind, nbytes, t in rows:
            size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            print(f"| {name} | {kind} | {size} | {t * 1e6:,.0f} µs | {nbytes / t / 1e6:,.0f} MB/s |")


if __name__ == "__main__":
    main()
