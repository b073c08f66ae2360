"""A small Horovod + torch job that tracks the way a generated train.py does.

    horovodrun -np 2 -H localhost:2 --gloo python tracked_training.py --workdir DIR --project NAME

Rank 0 keeps DIR/checkpoint.pt (weights, next epoch, MLflow run id); launching again resumes from
it and continues the same MLflow run. With --pause-at-step K every rank stops after step K until
DIR/resume exists (rank 0 first writes DIR/paused), so a test can act on the server mid-run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

from hvd_runtime.config import RunConfig
from hvd_runtime.tracking import start_tracking

SAMPLES, FEATURES, CLASSES, BATCH = 256, 8, 3, 16


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(dim=1)
    return x, y


def wait_for_resume(workdir: Path, step: int) -> None:
    if hvd.rank() == 0:
        (workdir / "paused").write_text(str(step))
    deadline = time.monotonic() + 120
    while not (workdir / "resume").exists():
        if time.monotonic() > deadline:
            raise SystemExit("no resume file after 120 s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--project", default="tracked")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--pause-at-step", type=int, default=-1)
    args = parser.parse_args()

    hvd.init()                                               # Horovod: one process per rank
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = RunConfig(run_dir=str(args.workdir / "run"))
    config.train.epochs, config.train.batch_size = args.epochs, BATCH

    x, y = make_data()
    x_shard, y_shard = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]   # Horovod: shard by rank
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())       # Horovod: scale lr
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    checkpoint = args.workdir / "checkpoint.pt"
    state = torch.load(checkpoint) if hvd.rank() == 0 and checkpoint.exists() else None
    if state is not None:
        model.load_state_dict(state["model"])
    # Horovod: an explicit name, since the default one (the type name) differs between dict and None
    state = hvd.broadcast_object(state and {"epoch": state["epoch"], "run_id": state["run_id"]}, root_rank=0,
                                 name="resume_state")
    start_epoch, run_id = (state["epoch"], state["run_id"]) if state else (0, None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # Horovod: same start on every rank

    tracker = start_tracking(config, rank=hvd.rank(), world_size=hvd.size(), framework="torch",
                             strategy="data", project_name=args.project, run_id=run_id)
    steps_per_epoch = len(x_shard) // BATCH
    step_seconds: list[float] = []
    with tracker:
        tracker.set_tags({"script": "tracked_training"})
        for epoch in range(start_epoch, args.epochs):
            model.train()
            for i in range(steps_per_epoch):
                began = time.perf_counter()
                step = epoch * steps_per_epoch + i
                batch = slice(i * BATCH, (i + 1) * BATCH)
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x_shard[batch]), y_shard[batch])
                loss.backward()
                optimizer.step()
                mean_loss = hvd.allreduce(loss.detach(), name="train_loss").item()   # Horovod: average
                tracker.log_metrics({"train/loss": mean_loss}, step=step)
                step_seconds.append(time.perf_counter() - began)
                if step == args.pause_at_step:
                    wait_for_resume(args.workdir, step)
            model.eval()
            with torch.no_grad():
                accuracy = (model(x_shard).argmax(dim=1) == y_shard).float().mean()
            accuracy = hvd.allreduce(accuracy, name="val_accuracy").item()           # Horovod: average
            tracker.log_metrics({"val/accuracy": accuracy}, step=epoch)
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "epoch": epoch + 1, "run_id": tracker.run_id}, checkpoint)
                tracker.log_artifact(checkpoint)
        tracker.log_model(model, input_example=x[:4].numpy())
        closing = time.perf_counter()
    closed_in = time.perf_counter() - closing

    if hvd.rank() != 0:
        assert "mlflow" not in sys.modules, "a rank other than 0 imported mlflow"
    split = args.pause_at_step + 1 if args.pause_at_step >= 0 else 0
    before, after = step_seconds[:split], step_seconds[split:]
    mean_ms = [1000 * sum(part) / max(len(part), 1) for part in (before, after)]
    print(f"rank {hvd.rank()} finished run_id={tracker.run_id} mean step ms: before pause {mean_ms[0]:.1f}, "
          f"after {mean_ms[1]:.1f}; close {closed_in:.2f} s", flush=True)


if __name__ == "__main__":
    main()
