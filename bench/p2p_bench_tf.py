"""Latency and throughput of the TensorFlow pipeline links: the socket link and hvd.alltoall.

    horovodrun -np 2 -H localhost:2 --gloo python bench/p2p_bench_tf.py [--quick]

The same ping-pong as bench/p2p_bench.py, through `hvd_runtime.tf.p2p`'s socket link (the code the
TensorFlow pipeline runs) and bench/p2p_links_tf.py's alltoall, taking turns size by size. Rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse

import tensorflow as tf

from hvd_runtime.tf.context import init_horovod
from hvd_runtime.pipeline.socket_link import connect_neighbours
from hvd_runtime.tf.p2p import SocketTensorLink
from p2p_links_tf import AlltoallLink
from pingpong import SIZES, iterations, pingpong, print_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    ctx = init_horovod(threads_per_rank=1)
    if ctx.size != 2:
        raise SystemExit(f"run with -np 2, got {ctx.size} ranks")
    import horovod.tensorflow as hvd

    me = ctx.rank
    prev, next_ = connect_neighbours(hvd, 0 if me == 1 else None, 1 if me == 0 else None)
    links = {"socket (TensorFlow)": SocketTensorLink(prev or next_),
             "hvd.alltoall (TensorFlow)": AlltoallLink(me, 1 - me, hvd.global_process_set)}
    rows = []
    for nbytes in SIZES:
        x = tf.random.normal([nbytes // 4])
        for name, link in links.items():
            rows.append((name, "header", nbytes, pingpong(link, x, me, iterations(nbytes, args.quick), False)))
    hvd.allreduce(tf.zeros([1]), name="done")
    if me == 0:
        print_table(rows)


if __name__ == "__main__":
    main()
