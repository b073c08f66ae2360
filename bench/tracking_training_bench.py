"""What MLflow tracking costs a generated project's training: untracked, and tracked with each
`tracking.checkpoint_models` setting, side by side.

    python bench/tracking_training_bench.py                    # 2 rounds, torch and TensorFlow
    python bench/tracking_training_bench.py --rounds 1 --frameworks torch

The default data-parallel project of each framework (`hvdgen new`: the digits MLP, 20 epochs),
trained with its README's line `horovodrun -np 2 -H localhost:2 --gloo python train.py`, from
scratch every time, in turned order each round: with `--tracking.enabled false`, and tracked in
the project's own store with `--tracking.checkpoint_models` every, auto and final. Rank 0's
MLflow runs in a tracking process beside it, except for Keras models, which it logs itself
(docs/tracking.md); on these 2 cores both ranks share them with it. Speed is the median of the epochs' train_samples_per_s after
the first; the table also gives the command's wall time and the models the run logged. Writes
docs/benchmarks-tracking.md.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from project_runs import bench_arguments, epoch_speed, readme_run, turned_rounds

SETTINGS = {
    "untracked": ["--tracking.enabled", "false"],
    "every": ["--tracking.checkpoint_models", "every"],
    "auto": ["--tracking.checkpoint_models", "auto"],
    "final": ["--tracking.checkpoint_models", "final"],
}


def logged_models(project: Path) -> int:
    """LoggedModels in the project's embedded store (0 when the run was untracked). Counted in a
    process of its own: MLflow keeps each store's connection open, and each run's store is new."""
    if not (project / "mlflow.db").exists():
        return 0
    count = ("from mlflow import MlflowClient; client = MlflowClient('sqlite:///mlflow.db'); "
             "print(len(client.search_logged_models(experiment_ids=[e.experiment_id for e in client.search_experiments()])))")
    return int(subprocess.run([sys.executable, "-c", count], cwd=project, capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def train(project: Path, options: list[str]) -> dict:
    """One run of the README line with `options`, from scratch: samples/s, wall time, models logged."""
    _, wall = readme_run(project, options)
    return {"samples_per_s": epoch_speed(project), "wall": wall, "models": logged_models(project)}


def report(runs: dict[tuple[str, str], list[dict]], rounds: int, load: tuple[float, float]) -> str:
    med = statistics.median
    rows = []
    for (framework, setting), results in runs.items():
        untracked = med(r["samples_per_s"] for r in runs[(framework, "untracked")])
        speed = med(r["samples_per_s"] for r in results)
        speeds = ", ".join(f"{r['samples_per_s']:,.0f}" for r in results)
        walls = ", ".join(f"{r['wall']:.1f}" for r in results)
        models = ", ".join(str(r["models"]) for r in results)
        rows.append(f"| {framework} | {setting} | {speeds} | {speed / untracked:.2f} | {walls} | {models} |")
    return "\n".join([
        "# What tracking costs the training",
        "",
        f"`python bench/tracking_training_bench.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({rounds} round{'s' if rounds > 1 else ''}, 1-minute load average {load[0]:.1f} before, {load[1]:.1f} "
        "after). Each framework's default data-parallel project (`hvdgen new`: the digits MLP, 20 epochs of "
        "about a tenth of a second), trained from scratch with its README's line `horovodrun -np 2 -H "
        "localhost:2 --gloo python train.py`, untracked and tracked in its own MLflow store with each "
        "`tracking.checkpoint_models` setting, in turned order each round. *samples/s* is the median of the "
        "epochs after the first; the wall time is the whole command's, start-up included.",
        "",
        "| framework | tracking | samples/s, by round | median / untracked | wall s, by round | models logged |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "Rank 0's MLflow work runs in a tracking process beside it ([tracking.md](tracking.md)): the "
        "store's creation, each epoch's metrics, the artifacts and torch checkpoint models (`torch.export`, "
        "MLflow's serving check, the store). On these 2 cores, which the two ranks keep busy, that process "
        "still takes CPU from them while it works, but no longer rank 0's interpreter. Keras models are "
        "logged in the training process, and training waits on the interpreter's lock meanwhile. `auto` "
        "logs a checkpoint only when that took at most a tenth of the time since the last one; on epochs "
        "this short, only the final model. The wall time holds the tracking process's start (MLflow's "
        "import, the store's tables: the first checkpoint waits for the run's id) and, after training, the "
        "final model's logging.",
        "",
    ])


def main() -> None:
    args = bench_arguments(__doc__, frameworks=True)
    load_before = os.getloadavg()[0]
    runs = turned_rounds(args, SETTINGS, train, lambda got: f"{got['samples_per_s']:,.0f} samples/s, "
                                                        f"{got['wall']:.1f} s, {got['models']} models", "tr")
    out = args.docs / "benchmarks-tracking.md"
    out.write_text(report(runs, args.rounds, (load_before, os.getloadavg()[0])))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
