"""Horovod's cycle time on CPU ranks: throughput at np=2 for several HOROVOD_CYCLE_TIME values.

    python bench/cycle_time_bench.py               # 2 rounds, about 12 minutes on 2 CPU cores
    python bench/cycle_time_bench.py --rounds 3

The measurement behind hvd_runtime.scaling.CPU_CYCLE_TIME_MS, the cycle CPU ranks run with where
Horovod's loop cannot wake when a tensor is queued: these runs turn the wake-up off
(HOROVOD_WAKE_ON_ENQUEUE=0), so each cycle time is a wait in every step. Our loop at np=2 on four workloads: the MLP of
bench/run.py, small (a step of a few ms) and large, and ResNet-18 and GPT from generated projects
on files on disk (bench/workload_bench.py); torch DDP (gloo) on the same ResNet-18 and GPT as the
yardstick. Rounds alternate the order of the cycle times; ratios are taken within a round. Writes
docs/benchmarks-cycle-time.md and docs/cycle-time.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as mlp_bench  # noqa: E402
import workload_bench  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
# HOROVOD_CYCLE_TIME in ms: Horovod's default first.
CYCLES_MS = (1.0, 5.0, 10.0, 25.0)
HOROVOD_DEFAULT_MS = CYCLES_MS[0]
WORKLOADS = {"mlp-small": "samples/s", "mlp-large": "samples/s", "resnet18": "images/s", "gpt": "tokens/s"}

Cycle = float | None  # a cycle time, or None: DDP


def label(cycle: Cycle) -> str:
    return "DDP" if cycle is None else f"{cycle:g} ms"


def measure(workload: str, cycle: Cycle, setup: dict) -> float:
    """Items/s of our loop at np=2 with that cycle time (ms), or of DDP when it is None."""
    if cycle is None:
        return workload_bench.run("ddp", 2, workload, *setup[workload])
    os.environ["HOROVOD_CYCLE_TIME"] = f"{cycle:g}"
    os.environ["HOROVOD_WAKE_ON_ENQUEUE"] = "0"
    try:
        if workload.startswith("mlp-"):
            width, batch = mlp_bench.WORKLOADS[workload.removeprefix("mlp-")]
            return mlp_bench.horovod_bench(2, "ours", 2, width, batch)
        return workload_bench.run("ours", 2, workload, *setup[workload])
    finally:
        del os.environ["HOROVOD_CYCLE_TIME"], os.environ["HOROVOD_WAKE_ON_ENQUEUE"]


def plot(relative: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(relative)
    for i, (workload, ratios) in enumerate(relative.items()):
        ax.bar([x + i * width for x in range(len(CYCLES_MS))], ratios, width, label=workload)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(CYCLES_MS))], [label(s) for s in CYCLES_MS], fontsize=8)
    ax.set_xlabel("HOROVOD_CYCLE_TIME")
    ax.set_ylabel("throughput / throughput at 1 ms (Horovod's default)")
    ax.set_title("Horovod's cycle time on 2 CPU ranks (np=2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[tuple[str, Cycle], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        setup = workload_bench.prepare(Path(tmp))
        for round_ in range(args.rounds):
            cycles = CYCLES_MS if round_ % 2 == 0 else CYCLES_MS[::-1]
            for workload in WORKLOADS:
                runs = (*cycles, None) if workload in workload_bench.MODELS else cycles
                for cycle in runs:
                    rate = measure(workload, cycle, setup)
                    results.setdefault((workload, cycle), []).append(rate)
                    print(f"round {round_}: {workload} {label(cycle)}: {rate:,.0f} {WORKLOADS[workload]}", flush=True)

    def ratio(workload: str, cycle: Cycle, base: Cycle) -> float:
        return statistics.median(a / b for a, b in zip(results[(workload, cycle)], results[(workload, base)]))

    header = " | ".join(label(s) for s in CYCLES_MS)
    lines = ["# Horovod's cycle time on CPU ranks", "",
             f"`python bench/cycle_time_bench.py` ({args.rounds} rounds, cycle times in alternating order; medians; "
             "ratios within a round). Our loop at np=2, one thread per rank, Gloo, on this machine's "
             f"{os.cpu_count()} cores; the workloads of bench/run.py (MLP) and bench/workload_bench.py (ResNet-18, "
             "GPT, read from disk). Columns: HOROVOD_CYCLE_TIME.", "",
             f"| workload | {header} | DDP |", "| --- |" + " ---: |" * (len(CYCLES_MS) + 1)]
    for workload, unit in WORKLOADS.items():
        cells = [f"{statistics.median(results[(workload, s)]):,.0f}" for s in CYCLES_MS]
        ddp = f"{statistics.median(results[(workload, None)]):,.0f}" if (workload, None) in results else "-"
        lines.append(f"| {workload} ({unit}) | {' | '.join(cells)} | {ddp} |")
    lines += ["", "Relative to Horovod's default (1 ms), and to DDP:", "",
              f"| workload | {header} |", "| --- |" + " ---: |" * len(CYCLES_MS)]
    relative = {w: [ratio(w, s, HOROVOD_DEFAULT_MS) for s in CYCLES_MS] for w in WORKLOADS}
    for workload in WORKLOADS:
        lines.append(f"| {workload} ÷ 1 ms | {' | '.join(f'{r:.2f}' for r in relative[workload])} |")
        if (workload, None) in results:
            lines.append(f"| {workload} ÷ DDP | {' | '.join(f'{ratio(workload, s, None):.2f}' for s in CYCLES_MS)} |")
    lines += ["", "![throughput against the cycle time](cycle-time.png)", ""]
    plot(relative, DOCS / "cycle-time.png")
    (DOCS / "benchmarks-cycle-time.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
