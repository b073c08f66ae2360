"""ZeRO on this machine: each rank's peak memory beside the ZeRO paper's bytes a parameter, and the speed of each stage.

    python bench/memory_bench_zero.py                         # width 1024, 8 layers: ~101 M parameters
    python bench/memory_bench_zero.py --width 256 --layers 2  # a quick look
    MALLOC_MMAP_THRESHOLD_=131072 python bench/memory_bench_zero.py --dp 4   # glibc handing memory back

One generated torch GPT project (data parallel, AdamW, fp32) trains a few steps and writes its
checkpoint under `horovodrun --gloo`, once per setting: at dp 4 with horovod.zero 0, 1, 2 and 3
(and 0 and 3 with `model.recompute blocks`), at dp 2 with each stage again. Every rank reads its
peak resident memory as bench/memory_bench_gpt.py's hook does: at parallelize (the baseline) and
at the first save_checkpoint (the peak while training).

Beside each setting: the training state the ZeRO paper gives for fp32 Adam (16, 8 + 8/N,
4 + 12/N and 16/N bytes a parameter), the activations the memory plan estimates (its `memory:`
line), and the worst rank's peak over baseline + state + activations, and over that plus the block
ZeRO 3 gathers whole (the plan's `a block gathered`). Speed: the run's
mean step time of its second epoch (the first holds the warm-up), each stage against zero 0 at the
same dp. `--rounds N` runs the settings N times over, one after another in turn, so that a drift
of the machine's speed reaches every setting alike; each figure is then the rounds' median, and
the step times of every round are listed. Writes docs/benchmarks-zero.md and its plot at the
default size.

    python bench/memory_bench_zero.py --dp 2 --rounds 3        # the speeds at dp 2, three rounds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_bench_gpt import HOOK  # noqa: E402

BIN = Path(sys.executable).parent
DOCS = Path(__file__).resolve().parent.parent / "docs"
# (ranks, horovod.zero, recompute)
SETTINGS = [(4, z, False) for z in range(4)] + [(4, 0, True), (4, 3, True)] + [(2, z, False) for z in range(4)]
PER_PARAMETER = {0: lambda n: 16, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 16 / n}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def run_all(width: int, layers: int, steps: int, rounds: int = 1) -> tuple[dict, int]:
    """Each setting's runs, a list of `rounds` results, and the model's parameter count."""
    heads, context, batch = 16 if width % 16 == 0 else 4, 128, 2
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([str(BIN / "hvdgen"), "new", "proj", "--model", "gpt", "--output", str(tmp)], check=True,
                       capture_output=True)
        project = tmp / "proj"
        # `steps` steps an epoch of the largest global batch (dp 4), and a validation window
        corpus = tmp / "corpus.txt"
        corpus.write_text(((project / "README.md").read_text() * 8)[: int((steps + 0.5) * 4 * batch * context / 0.9)])
        subprocess.run([sys.executable, "prepare_tokens.py", str(corpus), "--out", str(tmp / "tokens")],
                       cwd=project, check=True, capture_output=True)
        (tmp / "hook").mkdir()
        (tmp / "hook" / "sitecustomize.py").write_text(HOOK)
        for round_, (np_, zero, recompute) in [(r, setting) for r in range(rounds) for setting in SETTINGS]:
            folder = tmp / f"dp{np_}-zero{zero}-{recompute}-{round_}"
            folder.mkdir()
            cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable,
                   "train.py", "--train.epochs", "2", "--tracking.enabled", "false", "--data.path",
                   str(tmp / "tokens"), "--data.workers", "0", "--model.width", str(width), "--model.layers",
                   str(layers), "--model.heads", str(heads), "--model.context", str(context), "--train.batch_size",
                   str(batch), "--horovod.zero", str(zero), "--model.recompute", "blocks" if recompute else "none",
                   "--optim.warmup_epochs", "0",
                   "--checkpoint.dir", str(folder / "checkpoints"), "--run_dir", str(folder / "run")]
            env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", MEMORY_OUT=str(folder),
                       MEMORY_FRAMEWORK="torch",
                       PYTHONPATH=os.pathsep.join([str(tmp / "hook"), os.environ.get("PYTHONPATH", "")]))
            started = time.perf_counter()
            proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"dp {np_} zero {zero} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            ranks = sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda r: r["rank"])
            points = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
            run = {"ranks": ranks, "activations": planned(proc.stdout, "activations"),
                   "gathered": planned(proc.stdout, "a block gathered"), "step_s": step_seconds(points)}
            results.setdefault((np_, zero, recompute), []).append(run)
            print(f"round {round_ + 1}, dp {np_} zero {zero} recompute {recompute}: "
                  f"{time.perf_counter() - started:.0f} s, {run['step_s']:.2f} s a step", flush=True)
        parameters = parameter_count(project, width, layers, heads, context)
    return results, parameters


def planned(stdout: str, what: str) -> int:
    """A part of the memory plan (`activations`, `a block gathered`), from rank 0's `memory:` line, in
    bytes; 0 where the line has none."""
    found = re.search(what + r" ([\d.]+) (MiB|GiB)", stdout)
    return 0 if found is None else int(float(found.group(1)) * (2**20 if found.group(2) == "MiB" else 2**30))


def step_seconds(points: list[dict]) -> float:
    """The second epoch's mean step time: the first's holds the warm-up."""
    return points[-1]["train_step_time_ms"] / 1000


def parameter_count(project: Path, width: int, layers: int, heads: int, context: int) -> int:
    sys.path.insert(0, str(project))
    import torch  # noqa: F401

    from hvd_runtime.config import ModelConfig
    from model import build_model

    with torch.device("meta"):
        model = build_model(ModelConfig(width=width, layers=layers, heads=heads, context=context), (context,), 256)
    return sum(p.numel() for p in model.parameters())


def worst_rank(run: dict) -> tuple[int, int]:
    """(peak, baseline) of the run's rank with the highest peak."""
    worst = max(run["ranks"], key=lambda rank: rank["saves"][0][0])
    return worst["saves"][0][0], worst["baseline"]


def report(results: dict, parameters: int, width: int, layers: int, out: Path | None) -> None:
    rounds = max(len(runs) for runs in results.values())
    lines = [f"GPT of {parameters / 1e6:.1f} M parameters (width {width}, {layers} layers, context 128, batch 2 a "
             f"rank), AdamW, fp32. MiB per rank{f', medians of {rounds} rounds' if rounds > 1 else ''}:", "",
             "| dp | zero | recompute | paper's state | planned activations | planned block gathered "
             "| baseline (worst rank) | peak (worst rank) | peak / (baseline + state + activations) "
             "| peak / (baseline + state + activations + block gathered) | s a step | samples/s vs zero 0 |"
             + (" s a step, each round |" if rounds > 1 else ""),
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
             + (" --- |" if rounds > 1 else "")]
    speed = {}
    for (np_, zero, recompute), runs in results.items():
        state = PER_PARAMETER[zero](np_) * parameters
        peak = statistics.median(worst_rank(run)[0] for run in runs)
        base = statistics.median(worst_rank(run)[1] for run in runs)
        held = statistics.median(run["activations"] for run in runs)
        gathered = statistics.median(run.get("gathered", 0) for run in runs)
        step = statistics.median(run["step_s"] for run in runs)
        speed[(np_, zero, recompute)] = step
        plain = speed.get((np_, 0, recompute), step)
        each = " " + ", ".join(f"{run['step_s']:.2f}" for run in runs) + " |" if rounds > 1 else ""
        lines.append(f"| {np_} | {zero} | {'blocks' if recompute else 'none'} | {mib(state)} | {mib(held)} "
                     f"| {mib(gathered)} | {mib(base)} | {mib(peak)} | {peak / (base + state + held):.2f} "
                     f"| {peak / (base + state + held + gathered):.2f} | {step:.2f} | {plain / step:.2f} |{each}")
    print("\n".join(lines), flush=True)
    if out is None:
        return
    picture = out.with_suffix(".png")
    plot(results, parameters, picture)
    out.write_text("\n".join([
        "# ZeRO benchmark: each stage's memory and speed", "",
        f"`python bench/memory_bench_zero.py{f' --rounds {rounds}' if rounds > 1 else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2 cores, "
        "CPU (Gloo), ranks sharing the cores. A generated torch GPT project (data parallel) trains a few steps "
        "and writes a checkpoint at each setting; each rank's peak resident memory (ru_maxrss) is read where "
        "train.py calls parallelize (*baseline*: interpreter, torch, Horovod, the data) and where it first calls "
        "save_checkpoint (*peak*: the training steps). *Paper's state*: fp32 Adam's 16 bytes a parameter under "
        "ZeRO over N ranks: 16, 8 + 8/N, 4 + 12/N, 16/N. *Planned activations*: what the memory plan estimates "
        "a step keeps for backward. *Planned block gathered*: what the plan adds for ZeRO 3, which the paper's "
        "16/N leaves out: the largest block whole three times over (its gradients in backward, and the "
        "reduce-scatter's send and receive buffers). *s a step*: the second epoch's mean (the first holds the "
        "warm-up).", "",
        *lines, "", f"![peak memory per rank]({picture.name})", ""]))


def plot(results: dict, parameters: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, base, above, formula, gathered = [], [], [], [], []
    for (np_, zero, recompute), runs in results.items():
        peak = statistics.median(worst_rank(run)[0] for run in runs)
        baseline = statistics.median(worst_rank(run)[1] for run in runs)
        labels.append(f"dp {np_}\nzero {zero}{' rc' if recompute else ''}")
        base.append(baseline / 2**20)
        above.append((peak - baseline) / 2**20)
        formula.append((baseline + PER_PARAMETER[zero](np_) * parameters) / 2**20)
        gathered.append(formula[-1] + statistics.median(run.get("gathered", 0) for run in runs) / 2**20)
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar(x, base, color="lightgrey", label="baseline (interpreter, torch, Horovod, data)")
    ax.bar(x, above, bottom=base, color="tab:blue", label="peak while training, above the baseline")
    ax.scatter(x, formula, marker="_", s=600, color="black", zorder=3, label="baseline + the paper's state")
    ax.scatter([i for i in x if gathered[i] > formula[i]], [g for g, f in zip(gathered, formula) if g > f],
               marker="_", s=600, color="tab:red", zorder=3, label="... + the block ZeRO 3 gathers (the plan's)")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("MiB, worst rank")
    ax.set_title(f"ZeRO: peak resident memory per rank, GPT of {parameters / 1e6:.0f} M parameters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="training steps at dp 4 (dp 2 takes twice as many)")
    ap.add_argument("--dp", type=int, choices=(2, 4), help="only the settings at this dp (the report is not written)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every setting, in turn (medians reported)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    if args.dp:
        SETTINGS[:] = [s for s in SETTINGS if s[0] == args.dp]
    results, parameters = run_all(args.width, args.layers, args.steps, args.rounds)
    default = (args.width, args.layers) == (1024, 8) and not args.dp
    report(results, parameters, args.width, args.layers, DOCS / "benchmarks-zero.md" if default else None)


if __name__ == "__main__":
    main()
