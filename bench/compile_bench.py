"""train.compile on this machine's CPU: the generated torch projects compiled and eager, side by side.

    python bench/compile_bench.py               # 2 rounds, about 6 minutes on 2 cores
    python bench/compile_bench.py --rounds 3

The default data-parallel projects (`hvdgen new`: the digits MLP; `--model gpt`: the tiny GPT on
its README's tokens) trained untracked from scratch under `horovodrun -np N -H localhost:N --gloo`,
N 1 and 2, with `--train.compile on` and `off`, in turned order each round. Speed is the median
of the epochs' train_samples_per_s after the first; the warm-up is what rank 0 said the
compilation took. `auto` compiles on GPUs only: it would compile on a CPU only where every
compiled median here beat the eager one. Writes docs/benchmarks-compile.md.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from project_runs import BIN, bench_arguments, epoch_speed

CASES = {"mlp": ["--train.epochs", "6"], "gpt": ["--train.epochs", "3"]}
SETTINGS = [(np, mode) for np in (1, 2) for mode in ("on", "off")]


def run(project: Path, np: int, mode: str, options: list[str]) -> tuple[float, float | None]:
    """(samples/s, the compilation's warm-up in seconds or None) of one run from scratch."""
    for made in ("checkpoints", "runs"):
        subprocess.run(["rm", "-rf", str(project / made)], check=True)
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable, "train.py",
           "--tracking.enabled", "false", "--train.compile", mode, *options]
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    warm = re.search(r"warmed up in ([\d.]+) s", proc.stdout)
    return epoch_speed(project), float(warm.group(1)) if warm else None


def report(results: dict, rounds: int, load: tuple[float, float]) -> str:
    med = statistics.median
    rows, faster, won, lost, warm_ups = [], [], set(), set(), []
    for model in CASES:
        for np in (1, 2):
            on, off = results[(model, np, "on")], results[(model, np, "off")]
            ratio = med(s for s, _ in on) / med(s for s, _ in off)
            faster.append(ratio > 1)
            (won if ratio > 1 else lost).add(model)
            warm = [w for _, w in on if w is not None]
            warm_ups += warm
            rows.append(f"| {model} | {np} | {', '.join(f'{s:,.0f}' for s, _ in on)} | "
                        f"{', '.join(f'{s:,.0f}' for s, _ in off)} | {ratio:.2f} | "
                        f"{', '.join(f'{w:.1f}' for w in warm)} |")
    verdict = ("Compiled beat eager in every case: `auto` could compile on this CPU." if all(faster) else
               f"Compiled beat eager for {', '.join(sorted(won)) or 'no model'} and lost for "
               f"{', '.join(sorted(lost - won)) or 'none'} at some np: `auto` stays eager on a CPU and compiles on "
               f"GPUs; `on` compiles anywhere (a run first spends {min(warm_ups):.0f}-{max(warm_ups):.0f} s on "
               "the warm-up here).")
    return "\n".join([
        "# train.compile on a CPU: compiled against eager",
        "",
        f"`python bench/compile_bench.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({rounds} "
        f"round{'s' if rounds > 1 else ''}, 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after). "
        "Each torch project's default data-parallel form (`hvdgen new`: the digits MLP; `--model gpt`: the "
        "tiny GPT on its README's tokens), trained untracked from scratch under `horovodrun -np N -H "
        "localhost:N --gloo`, with `--train.compile on` and `off` in turned order each round. *samples/s* is "
        "the median of the epochs after the first; the warm-up is the compilation before the first step "
        "(inductor's cache is kept between runs, so later rounds' warm-ups are shorter).",
        "",
        "| model | np | compiled samples/s, by round | eager samples/s, by round | compiled / eager | warm-up s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        verdict,
        "",
    ])


def main() -> None:
    args = bench_arguments(__doc__)
    load_before = os.getloadavg()[0]
    results: dict = {(m, np, mode): [] for m in CASES for np, mode in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        projects = {}
        for model in CASES:
            subprocess.run([str(BIN / "hvdgen"), "new", f"compile_{model}", "--model", model, "--output", tmp],
                           check=True, capture_output=True)
            projects[model] = Path(tmp) / f"compile_{model}"
            if model == "gpt":
                subprocess.run([sys.executable, "prepare_tokens.py", "--out", "data/tokens"], cwd=projects[model],
                               check=True, capture_output=True)
        order = [(m, np, mode) for m in CASES for np, mode in SETTINGS]
        for r in range(args.rounds):
            for model, np, mode in (order if r % 2 == 0 else order[::-1]):
                got = run(projects[model], np, mode, CASES[model])
                results[(model, np, mode)].append(got)
                print(f"round {r + 1} {model} np {np} compile {mode}: {got[0]:,.0f} samples/s"
                      + (f", warm-up {got[1]:.1f} s" if got[1] is not None else ""), flush=True)
    out = args.docs / "benchmarks-compile.md"
    out.write_text(report(results, args.rounds, (load_before, os.getloadavg()[0])))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
