"""ResNet-18 images/s and GPT tokens/s: the generated loop against Horovod's example loop and the framework's own.

    python bench/workload_bench.py                          # torch: one round, about 2.5 minutes on 2 CPU cores
    python bench/workload_bench.py --rounds 3               # steadier medians
    python bench/workload_bench.py --framework tensorflow   # the Keras projects

For each model, at np=1 and np=2, three loops run back to back on the same model (from a freshly
generated project) and the same files on disk: our loop (horovodrun), the Horovod-example loop
(horovodrun) and what a user of the framework would pick instead: torch DDP (torchrun, gloo;
bench/workload_worker.py), or TensorFlow's MultiWorkerMirroredStrategy (one process per worker,
TF_CONFIG; bench/tf_workload_worker.py). Who goes first turns each round, and ratios are taken
within a round. Writes docs/benchmarks-workloads.md and docs/workloads.png (torch), or
docs/benchmarks-workloads-tensorflow.md and docs/workloads-tensorflow.png; bench/run.py runs both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import machine_speed

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FRAMEWORKS = ("torch", "tensorflow")
LOOPS = {"torch": ("ours", "reference", "ddp"), "tensorflow": ("ours", "reference", "mwms")}
LOOP_NAMES = {"ours": "ours", "reference": "Horovod example", "ddp": "DDP (torchrun)", "mwms": "MultiWorkerMirrored"}
WORKERS = {"torch": "workload_worker.py", "tensorflow": "tf_workload_worker.py"}
MODELS = {"resnet18": "images/s", "gpt": "tokens/s"}
SUFFIX = {"torch": "", "tensorflow": "-tensorflow"}  # of the report and plot files


def write_images(root: Path, per_class: int = 400, classes: int = 4, size: int = 32) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / str(c)).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / str(c) / f"{i}.png")


def prepare(tmp: Path, framework: str = "torch") -> dict[str, tuple[Path, Path]]:
    """model -> (generated project, its data)."""
    out = {}
    for model in MODELS:
        subprocess.run([str(BIN / "hvdgen"), "new", model, "--model", model, "--framework", framework,
                        "--output", str(tmp)], check=True, capture_output=True)
        out[model] = (tmp / model, tmp / f"{model}-data")
    write_images(out["resnet18"][1])
    subprocess.run([sys.executable, "prepare_tokens.py", "--out", str(out["gpt"][1]), "--max-bytes", "160000"],
                   cwd=out["gpt"][0], check=True, capture_output=True)
    return out


def run(loop: str, np_: int, model: str, project: Path, data: Path, framework: str = "torch") -> float:
    worker = [str(REPO / "bench" / WORKERS[framework]), "--loop", loop, "--model", model,
              "--project", str(project), "--data", str(data)]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    if loop == "mwms":
        cmd, stdout, stderr = worker, *tf_workers(np_, [sys.executable, *worker], env)
    else:
        if loop == "ddp":
            cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={np_}", *worker]
        else:
            cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable,
                   *worker]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        stdout, stderr = proc.stdout, proc.stderr
    for line in stdout.splitlines():
        if "BENCH " in line:
            return json.loads(line.split("BENCH ", 1)[1])["items_per_s"]
    raise RuntimeError(f"{' '.join(cmd)} printed no result:\n{stdout[-3000:]}\n{stderr[-3000:]}")


def tf_workers(np_: int, cmd: list[str], env: dict[str, str]) -> tuple[str, str]:
    """Start `np_` TensorFlow workers of one MultiWorkerMirroredStrategy cluster on this host (a
    TF_CONFIG each, as a cluster's launcher sets it). Returns rank 0's stdout, and the stderr of
    every worker that failed."""
    ports = []
    for _ in range(np_):
        with socket.socket() as s:  # free now; the workers bind them a moment later
            s.bind(("localhost", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    procs = [subprocess.Popen(cmd, env=dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {
        "type": "worker", "index": i}})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(np_)]
    try:
        outs = [proc.communicate(timeout=1200) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    return outs[0][0], "\n".join(f"worker {i} (exit {procs[i].returncode}):\n{outs[i][1][-2000:]}" for i in failed)


def plot(results: dict[tuple[str, int, str], list[float]], framework: str, path: Path) -> None:
    """One panel per model: the median rate of each loop against np, and ours scaled linearly."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4))
    for ax, (model, unit) in zip(axes, MODELS.items()):
        for loop in LOOPS[framework]:
            ax.plot((1, 2), [statistics.median(results[(model, n, loop)]) for n in (1, 2)], marker="o",
                    label=LOOP_NAMES[loop])
        one = statistics.median(results[(model, 1, "ours")])
        ax.plot((1, 2), (one, 2 * one), linestyle=":", color="grey", label="ours, linear scaling")
        ax.set_title(model)
        ax.set_xlabel("processes (-np)")
        ax.set_ylabel(unit)
        ax.set_xticks((1, 2))
        ax.legend()
    fig.suptitle(f"ResNet-18 and GPT, data parallel, {'PyTorch' if framework == 'torch' else 'TensorFlow (Keras 3)'} "
                 "(CPU, 1 thread per rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


INTRO = {
    "torch": ("# Workload benchmark: the generated loop against Horovod's example loop and torch DDP",
              "Ours is the runtime as generated projects run it, which on a CPU rank keeps the memory a step frees "
              "(hvd_runtime.host_memory); the other two loops run with glibc's malloc defaults, as a user starts "
              "them (docs/horovod-on-cpu.md, item 6, has DDP with the same settings)."),
    "tensorflow": ("# Workload benchmark, TensorFlow: the generated loop against Horovod's Keras example and "
                   "MultiWorkerMirroredStrategy",
                   "Ours is the runtime as generated Keras projects run it (hvd_runtime.tf: a compiled custom step "
                   "with one grouped allreduce, Gloo); the Horovod example is `horovod.tensorflow.keras` with "
                   "`model.fit`; MultiWorkerMirrored is tf.distribute's strategy (its ring collectives over gRPC), "
                   "one process per worker, in the custom loop of TensorFlow's multi-worker tutorial, since Keras 3's "
                   "`model.fit` fails under it with two workers. All three: SGD (momentum 0.9, lr 0.01 x workers), "
                   "the same reader (the split's `take` in tf.data's parallel map; the other two read one repeated "
                   "dataset through one iterator, as they are written)."),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--framework", choices=FRAMEWORKS, default="torch")
    parser.add_argument("--out", type=Path, help="default: docs/benchmarks-workloads[-tensorflow].md")
    args = parser.parse_args()
    framework, loops_of = args.framework, LOOPS[args.framework]
    out = args.out or REPO / "docs" / f"benchmarks-workloads{SUFFIX[framework]}.md"
    results: dict[tuple[str, int, str], list[float]] = {}
    speed = machine_speed.described()
    with tempfile.TemporaryDirectory() as tmp:
        setup = prepare(Path(tmp), framework)
        for round_ in range(args.rounds):
            loops = loops_of[round_ % len(loops_of):] + loops_of[:round_ % len(loops_of)]  # no loop always first
            for model, (project, data) in setup.items():
                for np_ in (1, 2):
                    for loop in loops:
                        rate = run(loop, np_, model, project, data, framework)
                        results.setdefault((model, np_, loop), []).append(rate)
                        print(f"round {round_}: {model} np={np_} {loop}: {rate:,.0f} {MODELS[model]}", flush=True)
    title, ours_note = INTRO[framework]
    other = LOOP_NAMES[loops_of[2]]
    command = "python bench/workload_bench.py" + (" --framework tensorflow" if framework == "tensorflow" else "")
    lines = [title, "",
             f"`{command}` ({args.rounds} round{'s' if args.rounds > 1 else ''}; medians; ratios within a round). "
             "Same model (the generated project's model.py: ResNet-18 width 16 on 32x32 images, GPT 4 layers x "
             "64 wide, context 64), same files on disk, per-rank batch 32, one thread per rank, no loader worker "
             f"processes, CPU. {ours_note} At the start, {speed}.", "",
             f"| model | np | ours | Horovod example | {other} | ours / example | ours / {other} |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, unit in MODELS.items():
        for np_ in (1, 2):
            ours, ref, theirs = (results[(model, np_, loop)] for loop in loops_of)
            ratio_ref = statistics.median(o / r for o, r in zip(ours, ref))
            ratio_theirs = statistics.median(o / d for o, d in zip(ours, theirs))
            lines.append(f"| {model} ({unit}) | {np_} | {statistics.median(ours):,.0f} | {statistics.median(ref):,.0f} "
                         f"| {statistics.median(theirs):,.0f} | {ratio_ref:.2f} | {ratio_theirs:.2f} |")
    lines += ["", "Scaling efficiency np=1 to 2: items/s at np=2 / (2 x items/s at np=1), median over rounds.", "",
              f"| model | ours | Horovod example | {other} |", "| --- | ---: | ---: | ---: |"]
    for model in MODELS:
        cells = []
        for loop in loops_of:
            one, two = results[(model, 1, loop)], results[(model, 2, loop)]
            cells.append(f"{statistics.median(b / (2 * a) for a, b in zip(one, two)):.2f}")
        lines.append(f"| {model} | {' | '.join(cells)} |")
    picture = f"workloads{SUFFIX[framework]}.png"
    plot(results, framework, out.parent / picture)
    lines += ["", f"![items/s against np]({picture})"]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
