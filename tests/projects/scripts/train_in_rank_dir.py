"""Run a generated project's train() with each rank in its own working directory.

Relative paths (checkpoints/, runs/, mlflow.db) then land in rankN/, so a test can see exactly
what each rank wrote. At the end, rank 0 records a digest of every rank's parameters (DIGEST=parameters: torch
parameters, or Keras trainable variables, only: leaving out BatchNorm's running statistics,
which are each worker's own between checkpoints by design).
KILL_AT_STEP=N (torch): rank 1 kills itself (SIGKILL) as it starts batch N, a run killed mid-epoch.
usage: PYTHONPATH=PROJECT horovodrun ... python train_in_rank_dir.py PROJECT RANKS_DIR [config overrides...]
(the project's modules import from PYTHONPATH: helpers.importing)

Its work runs under `__main__`, as train.py's does: DataLoader workers start from a fork server and
import this script again.
"""

import hashlib
import json
import os
import signal
import sys
from pathlib import Path


def enter_rank_dir() -> tuple[Path, Path, list[str]]:
    """PROJECT, RANKS_DIR and the overrides of argv; this rank now works in RANKS_DIR/rankN and
    imports the project's modules."""
    project, ranks_dir, overrides = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3:]
    workdir = ranks_dir / f"rank{os.environ['HOROVOD_RANK']}"
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return project, ranks_dir, overrides


def kill_at_step(step: int) -> None:
    """Rank 1 SIGKILLs itself as it starts batch `step` (torch's TrainStep). Its collectives of
    the batch before have met every rank's, so a checkpoint written before that batch is complete."""
    from hvd_runtime.torch.step import TrainStep

    train_batch = TrainStep.train_batch

    def killing(self, x, y, apply, at):
        if at == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return train_batch(self, x, y, apply, at)

    TrainStep.train_batch = killing


def main() -> None:
    project, ranks_dir, overrides = enter_rank_dir()
    if "KILL_AT_STEP" in os.environ and os.environ["HOROVOD_RANK"] == "1":
        kill_at_step(int(os.environ["KILL_AT_STEP"]))

    import numpy as np

    import train

    model, metrics = train.train(train.load_config(train.CONFIG_FILE, overrides))
    if os.environ.get("SKIP_DIGEST"):  # pipeline ranks hold different stages
        return
    if hasattr(model, "state_dict"):
        import horovod.torch as hvd

        state = dict(model.named_parameters()) if os.environ.get("DIGEST") == "parameters" else model.state_dict()
        weights = b"".join(state[k].detach().cpu().numpy().tobytes() for k in sorted(state))
    else:
        import horovod.tensorflow as hvd

        # Float variables only: integer ones are per-rank dropout seed states, meant to differ.
        variables = model.trainable_variables if os.environ.get("DIGEST") == "parameters" else model.variables
        weights = b"".join(np.asarray(v).tobytes() for v in variables if "float" in str(v.dtype))
    digests = hvd.allgather_object(hashlib.sha256(weights).hexdigest())
    if hvd.rank() == 0:
        (ranks_dir / "digests.json").write_text(json.dumps(digests))


if __name__ == "__main__":
    main()
