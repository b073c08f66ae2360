"""All benchmarks, measured side by side in one run; writes docs/benchmarks.md and its plots.

    python bench/run.py                 # about 5-10 minutes on 2 CPU cores
    python bench/run.py --rounds 5      # more rounds, steadier medians

(a) our training loop against one written like Horovod's official PyTorch example, -np 2;
(b) scaling efficiency of our loop, np=1 against np=2, one thread per rank;
(c) the pipeline benchmark (bench/pipeline_bench.py): bubble, activations in flight, speed-up;
(d) wall time of `hvdgen --help` and `hvdgen new`.
Every figure is the median of several rounds, and every ratio is taken within one round (the
runs it compares ran back to back), so slow phases of a shared machine cancel out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DOCS = REPO / "docs"


def horovod_bench(np: int, loop: str, epochs: int) -> float:
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable,
           str(REPO / "bench" / "dp_worker.py"), "--loop", loop, "--epochs", str(epochs)]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in out.stdout.splitlines():
        if "BENCH " in line:
            return json.loads(line.split("BENCH ", 1)[1])["samples_per_s"]
    raise RuntimeError(f"{' '.join(cmd)} printed no result:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def wall_time(cmd: list[str], repeat: int = 5, cwd: Path | None = None) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=cwd)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def machine() -> str:
    from importlib import metadata

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "horovod"))
    return (f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, no GPU; Python {platform.python_version()}, "
            f"{versions}, Gloo; load average at start {os.getloadavg()[0]:.1f}")


def plot_throughput(results: dict[str, dict[int, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for loop, by_np in results.items():
        nps = sorted(by_np)
        ax.plot(nps, [statistics.median(by_np[n]) for n in nps], marker="o", label=loop)
    nps = sorted(next(iter(results.values())))
    ours_one = statistics.median(results["ours"][1])
    ax.plot(nps, [ours_one * n for n in nps], linestyle=":", color="grey", label="ours, linear scaling")
    ax.set_xlabel("processes (-np)")
    ax.set_ylabel("training samples / s")
    ax.set_xticks(nps)
    ax.set_title("Data-parallel throughput (CPU, Gloo, 1 thread per rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--skip-pipeline", action="store_true")
    args = parser.parse_args()
    DOCS.mkdir(exist_ok=True)
    described = machine()
    print(described, flush=True)

    results: dict[str, dict[int, list[float]]] = {"ours": {1: [], 2: []}, "reference": {1: [], 2: []}}
    ratios, scaling_ours, scaling_ref = [], [], []
    for r in range(args.rounds):
        row = {}
        for np, loop in ((2, "ours"), (2, "reference"), (1, "ours"), (1, "reference")):
            row[(np, loop)] = horovod_bench(np, loop, args.epochs)
            results[loop][np].append(row[(np, loop)])
        ratios.append(row[(2, "ours")] / row[(2, "reference")])
        scaling_ours.append(row[(2, "ours")] / (2 * row[(1, "ours")]))
        scaling_ref.append(row[(2, "reference")] / (2 * row[(1, "reference")]))
        print(f"round {r + 1}: ours/reference at np=2 {ratios[-1]:.2f}, scaling ours {scaling_ours[-1]:.2f}, "
              f"reference {scaling_ref[-1]:.2f}", flush=True)
    plot_throughput(results, DOCS / "throughput.png")

    hvdgen = str(BIN / "hvdgen")
    help_s = wall_time([hvdgen, "--help"])
    with tempfile.TemporaryDirectory() as tmp:
        new_s = wall_time([hvdgen, "new", "bench", "--output", tmp, "--force"])

    pipeline_md = ""
    if not args.skip_pipeline:
        subprocess.run([sys.executable, str(REPO / "bench" / "pipeline_bench.py")], check=True)
        pipeline_md = (DOCS / "benchmarks-pipeline.md").read_text()

    med = statistics.median
    table = [
        "| measure | median | rounds |",
        "| --- | --- | --- |",
        f"| (a) ours / Horovod-example loop, samples/s at np=2 | **{med(ratios):.2f}x** | "
        f"{', '.join(f'{x:.2f}' for x in ratios)} |",
        f"| ours, samples/s at np=2 | {med(results['ours'][2]):.0f} | "
        f"{', '.join(f'{x:.0f}' for x in results['ours'][2])} |",
        f"| Horovod-example loop, samples/s at np=2 | {med(results['reference'][2]):.0f} | "
        f"{', '.join(f'{x:.0f}' for x in results['reference'][2])} |",
        f"| (b) scaling efficiency np=1 -> 2, ours | **{med(scaling_ours):.2f}** | "
        f"{', '.join(f'{x:.2f}' for x in scaling_ours)} |",
        f"| scaling efficiency np=1 -> 2, Horovod-example loop | {med(scaling_ref):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in scaling_ref)} |",
        f"| (d) `hvdgen --help` wall time | {help_s * 1000:.0f} ms | median of 5 |",
        f"| (d) `hvdgen new` wall time | {new_s * 1000:.0f} ms | median of 5 |",
    ]
    report = "\n".join([
        "# Benchmarks",
        "",
        f"Measured by `python bench/run.py` on {time.strftime('%Y-%m-%d')}: {described}.",
        "",
        "Data parallel: a 64-256-128-10 MLP on 19,000 synthetic samples, batch 32 per rank, SGD, "
        f"{args.epochs} timed epochs after one warm-up epoch, one thread per rank. The reference loop is "
        "written the way Horovod's PyTorch example is (DataLoader + DistributedSampler + "
        "DistributedOptimizer); ours is what generated projects run (hvd_runtime.torch).",
        "",
        *table,
        "",
        "![throughput against np](throughput.png)",
        "",
        "Efficiency is samples/s at np=2 divided by twice samples/s at np=1. On 2 cores two ranks "
        "also share the cores with Horovod's background threads, so this is a floor, not a cluster figure.",
        "",
        pipeline_md,
    ])
    (DOCS / "benchmarks.md").write_text(report)
    print("\n".join(table))
    print(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
