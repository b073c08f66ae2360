"""Checkpoints and the whole model for pipeline jobs, where each rank holds only its stage.

Rank 0 writes, as in every strategy: the stages' states are gathered to it (replica 0 of each
stage; the replicas are identical). A stage keeps its blocks' original names, so the union of
the stages' state dicts is the unsplit model's state dict: rank 0 can load it into the original
model, to log or export one ordinary model. Stages split by tensor parallelism (`split`, their
SplitParameters) are gathered whole first, so the file is the same at every tp and a run resumes
at another one. Gathering costs memory on rank 0 for a model too
big for one device; such models want per-stage checkpoints, which this module does not write.
"""

from __future__ import annotations

import torch
from torch import nn

from hvd_runtime.checkpoint import CheckpointStore, TrainState
from hvd_runtime.pipeline.checkpoint import checkpoint_payload, gather_stages, restore_own_stage
from hvd_runtime.torch.buffers import average_buffers
from hvd_runtime.torch.meta_init import whole
from hvd_runtime.torch.state import (_to_cpu, checkpoint_store, load_latest, model_misfit, rng_state, saved_shapes,
                                     set_rng_state)


def _gather_stages(stage: nn.Module, optimizer, dims, split=None) -> tuple[dict[int, dict], list[dict]]:
    """Every rank calls; returns ({stage index: {model, optimizer}} of replica 0, every rank's RNG state).

    A stage's replicas first agree on its BatchNorm statistics (hvd_runtime.torch.buffers); a
    tensor-parallel stage's slices are gathered whole (`split`), the same on each rank of its group.
    """
    import horovod.torch as hvd

    if dims.dp_set is not None:
        average_buffers(stage, process_set=dims.dp_set, name="pp.checkpoint.buffers")
    weights = stage.state_dict() if split is None else split.full_model_state()
    moments = None
    if optimizer is not None:
        moments = optimizer.state_dict() if split is None else split.full_optimizer_state(optimizer)
    return gather_stages(hvd, dims, _to_cpu(weights), _to_cpu(moments), rng_state())


def save_pipeline_checkpoint(store: CheckpointStore, stage: nn.Module, optimizer, state, dims, split=None):
    """Called by every rank; rank 0 writes one file with every stage."""
    stages, rngs = _gather_stages(stage, optimizer, dims, split)
    if not store.is_writer:
        return None
    payload = checkpoint_payload(stages, rngs, state, getattr(stage, "plan", None))
    return store.save(state.step, lambda path: torch.save(payload, path))


def restore_pipeline(store: CheckpointStore, stage: nn.Module, optimizer, dims, resume: bool = True,
                     split=None) -> TrainState:
    """Rank 0 reads the newest checkpoint and broadcasts it; each rank loads its own stage (with
    `split`, a tensor-parallel stage, its slices of the whole stage the file holds).

    A checkpoint that does not fit this pipeline stops every rank with the same ConfigError.
    """
    import horovod.torch as hvd

    payload = load_latest(store) if hvd.rank() == 0 and resume else None
    payload = hvd.broadcast_object(payload, root_rank=0, name="pp.restore")

    def load(mine: dict) -> None:
        stage.load_state_dict(mine["model"] if split is None else split.local_model_state(mine["model"]))
        if optimizer is not None and mine["optimizer"] is not None:
            moments = mine["optimizer"]
            optimizer.load_state_dict(moments if split is None else split.local_optimizer_state(optimizer, moments))

    return restore_own_stage(hvd, payload, dims, f"the checkpoint in {store.directory}",
                             lambda part: model_misfit(part["model"], saved_shapes(stage, split)), load, set_rng_state,
                             getattr(stage, "plan", None))


def newest_cut(checkpoint_cfg, ctx) -> dict | None:
    """Where the newest checkpoint's stages were cut (rank 0 reads it, every rank gets it); None
    when there is none to resume, or it predates kept cuts. Read before the stages are built."""
    import horovod.torch as hvd

    cut = None
    if ctx.is_root and checkpoint_cfg.resume:
        found = checkpoint_store(checkpoint_cfg, ctx).load_latest(
            lambda path: torch.load(path, map_location="cpu", weights_only=False))
        cut = found[1].get("cut") if found else None
    return hvd.broadcast_object(cut, root_rank=0, name="pp.newest_cut")


def gather_full_model(model: nn.Module, stage: nn.Module, dims, split=None) -> nn.Module:
    """Every rank calls; returns, on rank 0, `model` (the unsplit original, made real if it was on
    the meta device) with the trained weights; on the other ranks `model` as it was."""
    import horovod.torch as hvd

    stages, _ = _gather_stages(stage, None, dims, split)
    if hvd.rank() == 0:
        merged = {k: v for part in stages.values() for k, v in part["model"].items()}
        model = whole(model, seed=0)   # its values are the stages' next
        model.load_state_dict(merged)
    return model
