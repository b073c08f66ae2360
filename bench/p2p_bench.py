"""Latency and throughput of the point-to-point candidates between two pipeline stages.

    horovodrun -np 2 -H localhost:2 --gloo python bench/p2p_bench.py [--quick]

Ping-pong between ranks 0 and 1 through the socket link (`hvd_runtime.torch.p2p`, the code the
pipeline runs) and the links of bench/p2p_links.py: one-way time is half the round trip. "header" rows send a message whose shape the
receiver does not know (activations); "known" rows skip the header (gradients).
Rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch

from hvd_runtime.pipeline.socket_link import connect_neighbours
from hvd_runtime.torch.p2p import SocketTensorLink
from p2p_links import AlltoallLink, BroadcastLink, TorchDistLink, init_torch_distributed
from pingpong import SIZES, iterations, pingpong, print_table


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
    prev, next_ = connect_neighbours(hvd, 0 if me == 1 else None, 1 if me == 0 else None)
    tcp_prev, tcp_next = connect_neighbours(hvd, 0 if me == 1 else None, 1 if me == 0 else None, unix=False)
    links = {"hvd.alltoall": AlltoallLink(me, peer, hvd.global_process_set),
             "hvd.broadcast": BroadcastLink(me, peer, hvd.global_process_set),
             "torch.distributed": TorchDistLink(me, peer),
             "socket (Unix, one host)": SocketTensorLink(prev or next_),
             "socket (TCP)": SocketTensorLink(tcp_prev or tcp_next)}
    rows = []
    for nbytes in SIZES:
        x = torch.randn(nbytes // 4)
        for name, link in links.items():
            for known in ([False] if name == "hvd.alltoall" or name.startswith("socket") else [False, True]):
                t = pingpong(link, x, me, iterations(nbytes, args.quick), known)
                rows.append((name, "known" if known else "header", nbytes, t))
    hvd.barrier()
    if me == 0:
        print_table(rows)


if __name__ == "__main__":
    main()
