"""The epoch loop of a pipeline job and its closing timeline, shared by the PyTorch and TensorFlow engines.

Every stage of a replica walks the same batches (each engine takes what its stage needs from
them), and the engine reports loss and metrics already averaged over the replicas, identical on
every rank. So the loop only weights them by batch size and keeps the position in the epoch,
exactly as the data-parallel loops do, for exact resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from hvd_runtime.checkpoint import TrainState
from hvd_runtime.progress import progress
from hvd_runtime.throughput import Throughput
from hvd_runtime.timeline import load_timeline, measured_bubble, plot_timeline


def train_pipeline_epoch(engine, batches, state: TrainState, is_root: bool, log_every: int = 0,
                         on_log: Callable[[dict[str, float], int], None] | None = None,
                         before_step: Callable[[int], None] | None = None) -> dict[str, float]:
    """Train the rest of epoch `state.epoch`; return train_loss and train_<metric> means.

    before_step(step) runs before each step (e.g. a learning-rate schedule); every `log_every`
    steps, on_log({"step_train_loss": loss, <throughput since the last point>}, step).
    """
    sums: dict[str, float] = {}
    seen = 0
    speed = Throughput(batches.samples_per_step)
    batch_iter = progress(batches.batches(state.epoch, state.samples_in_epoch), enabled=is_root,
                          desc=f"epoch {state.epoch}", total=batches.steps(state.samples_in_epoch))
    for x, y in batch_iter:
        if before_step is not None:
            before_step(state.step)
        # Horovod: one step of the schedule; loss and metrics come averaged over replicas.
        loss, metrics = engine.train_step(x, y)
        n = int(np.shape(y)[0])
        for name, value in {"loss": loss, **metrics}.items():
            sums[f"train_{name}"] = sums.get(f"train_{name}", 0.0) + value * n
        seen += n
        state.step += 1
        state.samples_in_epoch += batches.samples_per_step
        speed.tokens_per_sample = int(np.prod(np.shape(y)[1:]))  # a language model's targets: one per token
        speed.step()
        if log_every and on_log is not None and state.step % log_every == 0:
            point = {"step_train_loss": loss, **speed.since_last()}
            if hasattr(batch_iter, "set_postfix_str"):
                batch_iter.set_postfix_str(f"{point['samples_per_s']:.0f} samples/s", refresh=False)
            on_log(point, state.step)
    state.epoch, state.samples_in_epoch = state.epoch + 1, 0
    if not seen:
        return {}
    return {name: total / seen for name, total in sums.items()} | {f"train_{k}": v for k, v in speed.epoch().items()}


def evaluate_pipeline(engine, batches) -> dict[str, float]:
    """val_loss and val_<metric> over the validation shards of every replica."""
    loss, metrics = engine.evaluate(batches)
    return {"val_loss": loss, **{f"val_{name}": value for name, value in metrics.items()}}


def close_timeline(engine, run_dir: Path, is_root: bool) -> dict | None:
    """Every rank calls: gather the timelines; rank 0 draws them and returns the bubble against theory.

    None on other ranks, and when this run trained no step (a restart after the last epoch).
    """
    engine.save_timeline(run_dir)
    if not is_root:
        return None
    timeline = load_timeline(run_dir)
    if not timeline.steps:
        return None
    stages, m = engine.dims.stages, engine.micro_batches
    return {"picture": plot_timeline(timeline, Path(run_dir) / "timeline.png"),
            "bubble_measured": measured_bubble(timeline), "bubble_theory": (stages - 1) / (m + stages - 1)}
