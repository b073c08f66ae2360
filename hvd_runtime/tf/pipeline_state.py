"""Checkpoints and the whole model for TensorFlow pipeline jobs, where each rank holds only its stage.

As for PyTorch (hvd_runtime.torch.pipeline_state): every rank hands its stage's variables to rank
0 (replica 0 of each stage; the replicas are identical), which writes one file; on start, rank 0
reads the newest checkpoint and every rank takes its own stage's part. Stages are runs of the
model's layers, so rank 0, which built the whole model, can put every stage's variables back
into it and log or export one ordinary Keras model.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from hvd_runtime.checkpoint import CheckpointStore, TrainState, state_fields
from hvd_runtime.tf.stage import Stage, build_stage
from hvd_runtime.tf.state import _assign, _read, rng_state, set_rng_state


def _gather_stages(stage: Stage, optimizer, dims) -> tuple[dict[int, dict], list[dict]]:
    """Every rank calls; returns ({stage index: {model, optimizer}} of replica 0, every rank's RNG state)."""
    import horovod.tensorflow as hvd

    mine = {"stage": dims.stage, "replica": dims.replica, "model": [np.asarray(v) for v in stage.variables],
            "optimizer": [np.asarray(v) for v in optimizer.variables] if optimizer is not None else None,
            "rng": rng_state()}
    parts = hvd.allgather_object(mine, name="pp.gather_stages")
    return {p["stage"]: p for p in parts if p["replica"] == 0}, [p["rng"] for p in parts]


def save_pipeline_checkpoint(store: CheckpointStore, stage: Stage, optimizer, state: TrainState, dims):
    """Called by every rank; rank 0 writes one file with every stage."""
    stages, rngs = _gather_stages(stage, optimizer, dims)
    if not store.is_writer:
        return None
    payload = {"stages": stages, "state": state_fields(state), "rng": rngs}

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)

    return store.save(state.step, write)


def restore_pipeline(store: CheckpointStore, stage: Stage, optimizer, dims, resume: bool = True) -> TrainState:
    """Rank 0 reads the newest checkpoint and broadcasts it; each rank loads its own stage."""
    import horovod.tensorflow as hvd

    found = store.load_latest(_read) if hvd.rank() == 0 and resume else None
    if found:
        print(f"resuming from {found[0]}: epoch {found[1]['state']['epoch']}, step {found[1]['state']['step']}",
              flush=True)
    payload = hvd.broadcast_object(found, root_rank=0, name="pp.restore")
    if payload is None:
        return TrainState()
    path, content = payload
    if "stages" not in content or dims.stage not in content["stages"]:
        raise ValueError(f"the checkpoint {path} was not written by a {dims.stages}-stage pipeline: "
                         "point --checkpoint.dir elsewhere, or pass --checkpoint.resume false")
    mine = content["stages"][dims.stage]
    _assign(stage.variables, mine["model"], "stage", Path(path))
    if optimizer is not None and mine["optimizer"] is not None:
        _assign(optimizer.variables, mine["optimizer"], "optimizer", Path(path))
    if content.get("rng") and len(content["rng"]) == hvd.size():
        set_rng_state(content["rng"][hvd.rank()])
    return TrainState(**content["state"])


def gather_full_model(model, stage: Stage, dims):
    """Every rank calls; on rank 0, `model` (the unsplit original) ends up with the trained variables."""
    import horovod.tensorflow as hvd

    stages, _ = _gather_stages(stage, None, dims)
    if hvd.rank() == 0:
        for k, part in stages.items():
            _assign(build_stage(model, k, stage.plan).variables, part["model"], f"stage {k}", Path("<gathered>"))
    return model
