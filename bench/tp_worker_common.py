"""What both tensor-parallel bench workers (tp_worker.py, tf_tp_worker.py) share: their arguments,
the GPT's config, the timing loop and the one `BENCH {...}` line rank 0 prints.

Framework-free, so that neither worker loads the other's framework.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

VOCAB = 256


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args()


def model_config(args: argparse.Namespace):
    """The benchmarked GPT: no dropout (tensor parallelism refuses it), the head tied to the embedding."""
    from hvd_runtime.config import ModelConfig

    return ModelConfig(width=args.width, layers=args.layers, heads=args.heads, context=args.context, dropout=0.0,
                       tie_embeddings=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed_steps(args: argparse.Namespace, train_step, barrier) -> tuple[list[float], float]:
    """Each step's seconds after the warm-up ones, between barriers, and the last step's loss."""
    times, loss = [], float("nan")
    for step in range(args.warmup + args.steps):
        barrier()
        started = time.perf_counter()
        loss = train_step()
        barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    return times, loss


def print_report(hvd, args: argparse.Namespace, times: list[float], loss: float, split_bytes: int,
                 param_bytes: int, rss_rise: int) -> None:
    """Every rank's numbers gathered; rank 0 prints them as one `BENCH [...]` line."""
    report = {"tp": args.tp, "ranks": hvd.size(), "threads": args.threads,
              "step_ms": 1000 * statistics.median(times), "loss": loss, "split_layer_bytes": split_bytes,
              "param_bytes": param_bytes, "training_rss_rise_bytes": rss_rise}
    reports = hvd.allgather_object(report)
    if hvd.rank() == 0:
        print("BENCH " + json.dumps(reports), flush=True)
