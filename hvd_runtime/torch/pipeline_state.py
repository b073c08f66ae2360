"""Checkpoints and the whole model for pipeline jobs, where each rank holds only its stage.

Rank 0 writes, as in every strategy: the stages' states are gathered to it (replica 0 of each
stage; the replicas are identical). A stage keeps its blocks' original names, so the union of
the stages' state dicts is the unsplit model's state dict: rank 0 can load it into the original
model, to log or export one ordinary model. Gathering costs memory on rank 0 for a model too
big for one device; such models want per-stage checkpoints, which this module does not write.
"""

from __future__ import annotations

import torch
from torch import nn

from hvd_runtime.checkpoint import CheckpointStore, TrainState, state_fields
from hvd_runtime.torch.state import _to_cpu, load_latest, rng_state, set_rng_state


def _gather_stages(stage: nn.Module, optimizer, dims) -> tuple[dict[int, dict], list[dict]]:
    """Every rank calls; returns ({stage index: {model, optimizer}} of replica 0, every rank's RNG state)."""
    import horovod.torch as hvd

    mine = {"stage": dims.stage, "replica": dims.replica, "model": _to_cpu(stage.state_dict()),
            "optimizer": _to_cpu(optimizer.state_dict()) if optimizer is not None else None,
            "rng": rng_state()}
    parts = hvd.allgather_object(mine, name="pp.gather_stages")
    return {p["stage"]: p for p in parts if p["replica"] == 0}, [p["rng"] for p in parts]


def save_pipeline_checkpoint(store: CheckpointStore, stage: nn.Module, optimizer, state, dims):
    """Called by every rank; rank 0 writes one file with every stage."""
    stages, rngs = _gather_stages(stage, optimizer, dims)
    if not store.is_writer:
        return None
    payload = {"stages": stages, "state": state_fields(state), "rng": rngs}
    return store.save(state.step, lambda path: torch.save(payload, path))


def restore_pipeline(store: CheckpointStore, stage: nn.Module, optimizer, dims, resume: bool = True) -> TrainState:
    """Rank 0 reads the newest checkpoint and broadcasts it; each rank loads its own stage."""
    import horovod.torch as hvd

    payload = load_latest(store) if hvd.rank() == 0 and resume else None
    payload = hvd.broadcast_object(payload, root_rank=0, name="pp.restore")
    if payload is None:
        return TrainState()
    if "stages" not in payload or dims.stage not in payload["stages"]:
        raise ValueError(f"the checkpoint in {store.directory} was not written by a {dims.stages}-stage pipeline: "
                         "point --checkpoint.dir elsewhere, or pass --checkpoint.resume false")
    mine = payload["stages"][dims.stage]
    stage.load_state_dict(mine["model"])
    if optimizer is not None and mine["optimizer"] is not None:
        optimizer.load_state_dict(mine["optimizer"])
    if payload.get("rng") and len(payload["rng"]) == hvd.size():
        set_rng_state(payload["rng"][hvd.rank()])
    return TrainState(**payload["state"])


def gather_full_model(model: nn.Module, stage: nn.Module, dims) -> nn.Module:
    """Every rank calls; on rank 0, `model` (the unsplit original) ends up with the trained weights."""
    import horovod.torch as hvd

    stages, _ = _gather_stages(stage, None, dims)
    if hvd.rank() == 0:
        merged = {k: v for part in stages.values() for k, v in part["model"].items()}
        model.load_state_dict(merged)
    return model
