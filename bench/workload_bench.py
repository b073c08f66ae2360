"""ResNet-18 images/s and GPT tokens/s: the generated loop against the Horovod example's and torch DDP's.

    python bench/workload_bench.py               # one round, about 2.5 minutes on 2 CPU cores
    python bench/workload_bench.py --rounds 3    # steadier medians

For each model, at np=1 and np=2, the three loops of bench/workload_worker.py run back to back
on the same model (from a freshly generated project) and the same files on disk: our loop
(horovodrun), the Horovod-example loop (horovodrun) and DDP (torchrun, gloo). Who goes first
turns each round, and ratios are taken within a round. Writes docs/benchmarks-workloads.md and
its plot, docs/workloads.png; bench/run.py runs it as part of every benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import machine_speed

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LOOPS = ("ours", "reference", "ddp")
MODELS = {"resnet18": "images/s", "gpt": "tokens/s"}


def write_images(root: Path, per_class: int = 480, classes: int = 4, size: int = 32) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / str(c)).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / str(c) / f"{i}.png")


def prepare(tmp: Path) -> dict[str, tuple[Path, Path]]:
    """model -> (generated project, its data)."""
    out = {}
    for model in MODELS:
        subprocess.run([str(BIN / "hvdgen"), "new", model, "--model", model, "--output", str(tmp)], check=True,
                       capture_output=True)
        out[model] = (tmp / model, tmp / f"{model}-data")
    write_images(out["resnet18"][1])
    subprocess.run([sys.executable, "prepare_tokens.py", "--out", str(out["gpt"][1]), "--max-bytes", "200000"],
                   cwd=out["gpt"][0], check=True, capture_output=True)
    return out


def run(loop: str, np_: int, model: str, project: Path, data: Path) -> float:
    worker = [str(REPO / "bench" / "workload_worker.py"), "--loop", loop, "--model", model,
              "--project", str(project), "--data", str(data)]
    if loop == "ddp":
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={np_}", *worker]
    else:
        cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, *worker]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    for line in proc.stdout.splitlines():
        if "BENCH " in line:
            return json.loads(line.split("BENCH ", 1)[1])["items_per_s"]
    raise RuntimeError(f"{' '.join(cmd)} printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def plot(results: dict[tuple[str, int, str], list[float]], path: Path) -> None:
    """One panel per model: the median rate of each loop against np, and ours scaled linearly."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4))
    for ax, (model, unit) in zip(axes, MODELS.items()):
        for loop in LOOPS:
            ax.plot((1, 2), [statistics.median(results[(model, n, loop)]) for n in (1, 2)], marker="o", label=loop)
        one = statistics.median(results[(model, 1, "ours")])
        ax.plot((1, 2), (one, 2 * one), linestyle=":", color="grey", label="ours, linear scaling")
        ax.set_title(model)
        ax.set_xlabel("processes (-np)")
        ax.set_ylabel(unit)
        ax.set_xticks((1, 2))
        ax.legend()
    fig.suptitle("ResNet-18 and GPT, data parallel (CPU, Gloo, 1 thread per rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-workloads.md")
    args = parser.parse_args()
    results: dict[tuple[str, int, str], list[float]] = {}
    speed = machine_speed.described()
    with tempfile.TemporaryDirectory() as tmp:
        setup = prepare(Path(tmp))
        for round_ in range(args.rounds):
            loops = LOOPS[round_ % len(LOOPS):] + LOOPS[:round_ % len(LOOPS)]  # no loop always first
            for model, (project, data) in setup.items():
                for np_ in (1, 2):
                    for loop in loops:
                        rate = run(loop, np_, model, project, data)
                        results.setdefault((model, np_, loop), []).append(rate)
                        print(f"round {round_}: {model} np={np_} {loop}: {rate:,.0f} {MODELS[model]}", flush=True)
    lines = ["# Workload benchmark: the generated loop against Horovod's example loop and torch DDP", "",
             "`python bench/workload_bench.py` "
             f"({args.rounds} round{'s' if args.rounds > 1 else ''}; medians; ratios within a round). "
             "Same model (the generated project's model.py: ResNet-18 width 16 on 32x32 images, GPT 4 layers x "
             "64 wide, context 64), same files on disk, per-rank batch 32, one thread per rank, no loader worker "
             "processes, CPU (Gloo). Ours is the runtime as generated projects run it, which on a CPU rank keeps "
             "the memory a step frees (hvd_runtime.host_memory); the other two loops run with glibc's malloc "
             "defaults, as a user starts them (docs/horovod-on-cpu.md, item 6, has DDP with the same settings). "
             f"At the start, {speed}.", "",
             "| model | np | ours | Horovod example | DDP (torchrun) | ours / example | ours / DDP |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, unit in MODELS.items():
        for np_ in (1, 2):
            ours, ref, ddp = (results[(model, np_, loop)] for loop in LOOPS)
            ratio_ref = statistics.median(o / r for o, r in zip(ours, ref))
            ratio_ddp = statistics.median(o / d for o, d in zip(ours, ddp))
            lines.append(f"| {model} ({unit}) | {np_} | {statistics.median(ours):,.0f} | {statistics.median(ref):,.0f} "
                         f"| {statistics.median(ddp):,.0f} | {ratio_ref:.2f} | {ratio_ddp:.2f} |")
    lines += ["", "Scaling efficiency np=1 to 2: items/s at np=2 / (2 x items/s at np=1), median over rounds.", "",
              "| model | ours | Horovod example | DDP (torchrun) |", "| --- | ---: | ---: | ---: |"]
    for model in MODELS:
        cells = []
        for loop in LOOPS:
            one, two = results[(model, 1, loop)], results[(model, 2, loop)]
            cells.append(f"{statistics.median(b / (2 * a) for a, b in zip(one, two)):.2f}")
        lines.append(f"| {model} | {' | '.join(cells)} |")
    plot(results, args.out.parent / "workloads.png")
    lines += ["", "![items/s against np](workloads.png)"]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
