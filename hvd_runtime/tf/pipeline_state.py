"""Checkpoints and the whole model for TensorFlow pipeline jobs, where each rank holds only its stage.

The protocol is hvd_runtime.pipeline.checkpoint's, as for PyTorch: every rank hands its stage's variables to rank
0 (replica 0 of each stage; the replicas are identical), which writes one file; on start, rank 0
reads the newest checkpoint and every rank takes its own stage's part. Stages are runs of the
model's layers, so rank 0, which built the whole model, can put every stage's variables back
into it and log or export one ordinary Keras model. Stages split by tensor parallelism (`split`,
their SplitVariables) are gathered whole first, so the file is the same at every tp and a run
resumes at another one.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from hvd_runtime.checkpoint import CheckpointStore, TrainState
from hvd_runtime.pipeline.checkpoint import checkpoint_payload, gather_stages, restore_own_stage
from hvd_runtime.tf.buffers import average_statistics
from hvd_runtime.tf.stage import Stage, rank_stage
from hvd_runtime.tf.state import _assign, _read, checkpoint_store, load_latest, misfit, rng_state, set_rng_state


def _gather_stages(stage: Stage, optimizer, dims, split=None) -> tuple[dict[int, dict], list[dict]]:
    """Every rank calls; returns ({stage index: {model, optimizer}} of replica 0, every rank's RNG state).

    A stage's replicas first agree on its BatchNorm statistics (hvd_runtime.tf.buffers); a
    tensor-parallel stage's slices are gathered whole (`split`), the same on each rank of its group.
    """
    import horovod.tensorflow as hvd

    if dims.dp_set is not None:
        average_statistics(stage, process_set=dims.dp_set, name="pp.checkpoint.statistics")
    weights = [np.asarray(v) for v in stage.variables] if split is None else split.full_model_arrays()
    moments = None
    if optimizer is not None:
        moments = ([np.asarray(v) for v in optimizer.variables] if split is None
                   else split.full_optimizer_arrays(optimizer))
    return gather_stages(hvd, dims, weights, moments, rng_state())


def save_pipeline_checkpoint(store: CheckpointStore, stage: Stage, optimizer, state: TrainState, dims, split=None):
    """Called by every rank; rank 0 writes one file with every stage."""
    stages, rngs = _gather_stages(stage, optimizer, dims, split)
    if not store.is_writer:
        return None
    payload = checkpoint_payload(stages, rngs, state, getattr(stage, "plan", None))

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)

    return store.save(state.step, write)


def restore_pipeline(store: CheckpointStore, stage: Stage, optimizer, dims, resume: bool = True,
                     split=None) -> TrainState:
    """Rank 0 reads the newest checkpoint and broadcasts it; each rank loads its own stage (with
    `split`, a tensor-parallel stage, its slices of the whole stage the file holds).

    A checkpoint that does not fit this pipeline stops every rank with the same ConfigError.
    """
    import horovod.tensorflow as hvd

    found = load_latest(store) if hvd.rank() == 0 and resume else None
    path, payload = hvd.broadcast_object(found, root_rank=0, name="pp.restore") or (None, None)

    def misfit_of(part: dict) -> str | None:
        shapes = None if split is None else split.saved_model_shapes()
        problem = misfit(stage.variables, part["model"], "stage", shapes)
        if problem is None and optimizer is not None and part["optimizer"] is not None:
            shapes = None if split is None else split.saved_optimizer_shapes(optimizer)
            problem = misfit(optimizer.variables, part["optimizer"], "optimizer", shapes)
        return problem

    def load(mine: dict) -> None:
        weights = mine["model"] if split is None else split.local_model_arrays(mine["model"])
        _assign(stage.variables, weights, "stage", Path(path))
        if optimizer is not None and mine["optimizer"] is not None:
            moments = mine["optimizer"]
            _assign(optimizer.variables, moments if split is None else split.local_optimizer_arrays(optimizer, moments),
                    "optimizer", Path(path))

    return restore_own_stage(hvd, payload, dims, f"the checkpoint {path}", misfit_of, load, set_rng_state,
                             getattr(stage, "plan", None))


def newest_cut(checkpoint_cfg, ctx) -> dict | None:
    """Where the newest checkpoint's stages were cut (rank 0 reads it, every rank gets it); None
    when there is none to resume, or it predates kept cuts. Read before the stages are built."""
    import horovod.tensorflow as hvd

    cut = None
    if ctx.is_root and checkpoint_cfg.resume:
        found = checkpoint_store(checkpoint_cfg, ctx).load_latest(_read)
        cut = found[1].get("cut") if found else None
    return hvd.broadcast_object(cut, root_rank=0, name="pp.newest_cut")


def gather_full_model(model, stage: Stage, dims, split=None):
    """Every rank calls; on rank 0, `model` (the unsplit original) ends up with the trained variables."""
    import horovod.tensorflow as hvd

    stages, _ = _gather_stages(stage, None, dims, split)
    if hvd.rank() == 0:
        for k, part in stages.items():
            _assign(rank_stage(model, k, stage.plan, dims.stages).variables, part["model"], f"stage {k}",
                    Path("<gathered>"))
    return model
