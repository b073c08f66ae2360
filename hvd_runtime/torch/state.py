"""Training state across restarts: rank 0 writes checkpoints, every rank starts from rank 0's state.

On start, rank 0 loads its newest readable checkpoint (or takes its freshly initialised model)
and broadcasts it, so all ranks begin bit-identical whatever their own initialisation was. A
checkpoint holds what an exact resume needs: model, optimizer, the position in the epoch (in
samples, so a resized job carries on too), and each rank's RNG state, handed back to the same
rank. The LR schedule is a function of the step, so it needs no state of its own.
"""

from __future__ import annotations

import random
import numpy as np
import torch
from torch import nn

from hvd_runtime.checkpoint import (CheckpointStore, ElasticStart, TrainState, announce_resume, misfit_message,
                                   root_payload, state_fields)
from hvd_runtime.config import ConfigError
from hvd_runtime.torch.buffers import average_buffers
from hvd_runtime.torch.context import Context


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def snapshot(model: nn.Module, optimizer, state, rng_states=None, split=None) -> dict:
    """What a checkpoint holds. With `split` (a tensor-parallel model's SplitParameters; every rank
    must then call this) the weights and optimizer state are gathered whole, as the unsplit model's."""
    weights = model.state_dict() if split is None else split.full_model_state()
    moments = optimizer.state_dict() if split is None else split.full_optimizer_state(optimizer)
    return {"model": _to_cpu(weights), "optimizer": _to_cpu(moments), "state": state_fields(state), "rng": rng_states}


def load_latest(store: CheckpointStore) -> dict | None:
    """The newest readable checkpoint's payload (on CPU), announced on stdout; None if there is none."""
    found = store.load_latest(lambda p: torch.load(p, map_location="cpu", weights_only=False))
    if found is None:
        return None
    announce_resume(*found)
    return found[1]


def model_misfit(saved: dict, current: dict) -> str | None:
    """Why a checkpoint's weights cannot load into this model (another dataset's classes, other
    layer sizes), as the config error the user sees; None when they fit. `current`: the model's
    state_dict, or the shapes it has in a checkpoint (saved_shapes)."""
    shapes = {k: tuple(v.shape) for k, v in saved.items()}
    wanted = {k: tuple(getattr(v, "shape", v)) for k, v in current.items()}
    if shapes == wanted:
        return None
    differ = sorted(k for k in set(shapes) | set(wanted) if shapes.get(k) != wanted.get(k))
    return misfit_message(f"{differ[0]}: {shapes.get(differ[0])} saved, {wanted.get(differ[0])} now")


def saved_shapes(model: nn.Module, split=None) -> dict[str, tuple[int, ...]]:
    """The shapes of this model's weights in a checkpoint (a tensor-parallel model's: the unsplit ones)."""
    return split.saved_shapes() if split is not None else {k: tuple(v.shape) for k, v in model.state_dict().items()}


def restore_or_broadcast(store: CheckpointStore, model: nn.Module, optimizer, ctx: Context,
                         resume: bool = True, split=None) -> TrainState:
    """Load rank 0's latest checkpoint (if any) into every rank; return where training stands.

    split: a tensor-parallel model's SplitParameters. Checkpoints then hold the unsplit model
    (whatever tp wrote them) and each rank loads its slices; a fresh start gathers every rank's
    slices first, so all replicas begin from one model.
    """
    import horovod.torch as hvd

    fresh = snapshot(model, optimizer, TrainState(), split=split) if split is not None else None
    payload = None
    if ctx.is_root:
        payload = (load_latest(store) if resume else None) or fresh or snapshot(model, optimizer, TrainState())
        misfit = model_misfit(payload["model"], saved_shapes(model, split))
        if misfit:
            payload = {"misfit": misfit}
    # Horovod: every rank starts from rank 0's weights, optimizer state and position.
    payload = hvd.broadcast_object(payload, root_rank=0, name="initial_state")
    if "misfit" in payload:  # every rank stops with rank 0's reason, none waits for the others
        raise ConfigError(payload["misfit"])
    if split is not None:
        payload["model"] = split.local_model_state(payload["model"])
        payload["optimizer"] = split.local_optimizer_state(optimizer, payload["optimizer"])
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    rngs = payload.get("rng")
    if rngs and len(rngs) == ctx.size:
        set_rng_state(rngs[ctx.rank])
    return TrainState(**payload["state"])


def restore_on_root(store: CheckpointStore, model: nn.Module, optimizer, ctx: Context,
                    resume: bool = True) -> ElasticStart:
    """Rank 0 alone loads its latest checkpoint (if any), with no collective: an elastic job's
    state reaches the other ranks in its first sync (see ElasticStart). RNG states are not handed
    back (the world may differ)."""
    payload = load_latest(store) if ctx.is_root and resume else None
    if payload is None:
        return ElasticStart()
    refusal = model_misfit(payload["model"], saved_shapes(model))
    if refusal:
        return ElasticStart(refusal=refusal)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    return ElasticStart(**payload["state"])


def save_checkpoint(store: CheckpointStore, model: nn.Module, optimizer, state, split=None):
    """Called by every rank (running statistics are averaged, RNG states gathered, a tensor-parallel
    model's slices gathered with `split`); only rank 0 writes."""
    import horovod.torch as hvd

    average_buffers(model, name="checkpoint.buffers")
    payload = root_payload(hvd, store, snapshot, rng_state, model, optimizer, state, split)
    if payload is None:
        return None
    return store.save(state.step, lambda path: torch.save(payload, path))


def checkpoint_store(cfg, ctx: Context) -> CheckpointStore:
    """Rank 0 writes the checkpoints; other ranks never touch the disk."""
    return CheckpointStore(cfg.dir, cfg.keep, is_writer=ctx.is_root)
