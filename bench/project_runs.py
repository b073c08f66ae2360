"""What the benchmarks of generated projects share: running a project's README line from scratch,
and their command line (rounds, the docs folder)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DOCS = REPO / "docs"
FRAMEWORKS = ("torch", "tensorflow")


def readme_run(project: Path, options: list[str] = ()) -> tuple[subprocess.CompletedProcess, float]:
    """`horovodrun -np 2 -H localhost:2 --gloo python train.py [options]` in `project` from scratch
    (no checkpoints, runs or MLflow store of an earlier run), tracked, if at all, in the project's
    own store. Returns the finished process and its wall time; raises if it failed."""
    for made in ("checkpoints", "runs", "mlflow.db", "mlruns"):
        path = project / made
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "train.py", *options]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=900, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {project} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, wall


def epoch_speed(project: Path) -> float:
    """The median of the latest run's epochs' train_samples_per_s, the first (warming up) left out."""
    epochs = [json.loads(line) for line in (project / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(e["train_samples_per_s"] for e in epochs[1:])


def turned_rounds(args: argparse.Namespace, settings: dict[str, list[str]], run: Callable[[Path, list[str]], object],
                  said: Callable[[object], str], tag: str) -> dict[tuple[str, str], list]:
    """Each of args.frameworks' default project (`hvdgen new`), `run(project, options)` for each
    setting's options, args.rounds times, in turned order (reversed every other round) so that a
    drift of the machine's speed falls on every setting alike; `said(result)` is printed as each
    one ends. Returns {(framework, setting): [each round's result]}."""
    runs: dict[tuple[str, str], list] = {(f, s): [] for f in args.frameworks for s in settings}
    order = list(runs)
    with tempfile.TemporaryDirectory() as tmp:
        projects = {}
        for framework in args.frameworks:
            subprocess.run([str(BIN / "hvdgen"), "new", f"{tag}_{framework}", "--framework", framework,
                            "--output", tmp], check=True, capture_output=True)
            projects[framework] = Path(tmp) / f"{tag}_{framework}"
        for r in range(args.rounds):
            for framework, setting in (order if r % 2 == 0 else order[::-1]):
                got = run(projects[framework], settings[setting])
                runs[(framework, setting)].append(got)
                print(f"round {r + 1} {framework} {setting}: {said(got)}", flush=True)
    return runs


def bench_arguments(doc: str, frameworks: bool = False) -> argparse.Namespace:
    """--rounds (1 or more, default 2), --docs (made if missing) and, if asked, --frameworks."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    if frameworks:
        parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--docs", type=Path, default=DOCS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    args.docs.mkdir(parents=True, exist_ok=True)
    return args
