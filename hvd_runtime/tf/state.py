"""Training state across restarts: rank 0 writes checkpoints, every rank starts from rank 0's state.

A checkpoint holds the Keras model's variables, the optimizer's variables (slots, iteration
count, hence the warmup position), the epoch and step, and every rank's Python and NumPy RNG
state. On start, rank 0 loads its newest readable checkpoint into its model, then broadcasts
the variables, so all ranks begin identical whatever their own initialisation was.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np

from hvd_runtime.checkpoint import (CheckpointStore, ElasticStart, TrainState, announce_resume, misfit_message,
                                   root_payload, state_fields)
from hvd_runtime.config import ConfigError
from hvd_runtime.tf.buffers import average_statistics
from hvd_runtime.tf.context import Context

SUFFIX = "pkl"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def shared_variables(model, optimizer, local_variables=()) -> list:
    """What every rank must hold identically: float model variables and all optimizer variables.

    Integer variables in a Keras model are RNG seed states (Dropout's SeedGenerator): each rank
    keeps its own, so dropout masks differ across ranks. Local variables stay per rank too.
    """
    local = {id(v) for v in local_variables}
    model_vars = [v for v in model.variables if "float" in str(v.dtype) and id(v) not in local]
    return model_vars + list(optimizer.variables)


def snapshot(model, optimizer, state: TrainState, rng_states=None, split=None) -> dict:
    """What a checkpoint holds. With `split` (a tensor-parallel model's SplitVariables; every rank
    must then call this) the variables are gathered whole, as the unsplit model's."""
    if split is not None:
        return {"model": split.full_model_arrays(), "optimizer": split.full_optimizer_arrays(optimizer),
                "state": state_fields(state), "rng": rng_states}
    return {"model": [np.asarray(v) for v in model.variables],
            "optimizer": [np.asarray(v) for v in optimizer.variables],
            "state": state_fields(state), "rng": rng_states}


def misfit(variables, arrays, what: str, shapes=None) -> str | None:
    """Why saved arrays cannot be assigned to these variables, as the user's config error; None if they fit.

    shapes: the variables' shapes in a checkpoint, where they differ from their own (a split model's).
    """
    if len(variables) != len(arrays):
        return misfit_message(f"{len(arrays)} {what} arrays saved, {len(variables)} variables now")
    for v, a, shape in zip(variables, arrays, shapes or [tuple(v.shape) for v in variables]):
        if tuple(shape) != tuple(a.shape):
            return misfit_message(f"{v.path}: {tuple(a.shape)} saved, {tuple(shape)} now")
    return None


def _assign(variables, arrays, what: str = "model", path: Path | None = None) -> None:
    problem = misfit(variables, arrays, what)
    if problem:
        raise ConfigError(problem if path is None else f"{path}: {problem}")
    for v, a in zip(variables, arrays):
        v.assign(a)


def _read(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def load_latest(store: CheckpointStore) -> tuple[Path, dict] | None:
    """(path, payload) of the newest readable checkpoint, announced on stdout; None if there is none."""
    found = store.load_latest(_read)
    if found is not None:
        announce_resume(*found)
    return found


def restore_or_broadcast(store: CheckpointStore, model, optimizer, ctx: Context, resume: bool = True,
                         local_variables=(), split=None) -> TrainState:
    """Load rank 0's latest checkpoint (if any) into every rank; return where training stands.

    The optimizer's variables are created here, before the broadcast, so they are synchronised
    along with the model's instead of after a first step that already used them.
    split: a tensor-parallel model's SplitVariables (see restore_split).
    """
    import horovod.tensorflow as hvd

    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    if split is not None:
        return restore_split(store, model, optimizer, ctx, split, resume)
    meta = {"state": asdict(TrainState()), "rng": None}
    if ctx.is_root:
        found = load_latest(store) if resume else None
        if found:
            _, payload = found
            problem = (misfit(model.variables, payload["model"], "model")
                       or misfit(optimizer.variables, payload["optimizer"], "optimizer"))
            if problem:
                meta = {"misfit": problem}
            else:
                _assign(model.variables, payload["model"])
                _assign(optimizer.variables, payload["optimizer"])
                meta = {"state": payload["state"], "rng": payload["rng"]}
    meta = hvd.broadcast_object(meta, root_rank=0, name="initial_state")
    if "misfit" in meta:  # every rank stops with rank 0's reason, none waits for the others
        raise ConfigError(meta["misfit"])
    # Horovod: every rank starts from rank 0's weights, optimizer state and position.
    hvd.broadcast_variables([v.value for v in shared_variables(model, optimizer, local_variables)], root_rank=0)
    rngs = meta["rng"]
    if rngs and len(rngs) == ctx.size:
        set_rng_state(rngs[ctx.rank])
    return TrainState(**meta["state"])


def restore_split(store: CheckpointStore, model, optimizer, ctx: Context, split, resume: bool = True) -> TrainState:
    """A tensor-parallel model: checkpoints hold the unsplit model (whatever tp wrote them); rank 0
    sends the whole arrays and each rank assigns its slices. A fresh start gathers every rank's
    slices first, so all replicas begin from one model."""
    import horovod.tensorflow as hvd

    fresh = snapshot(model, optimizer, TrainState(), split=split)
    payload = None
    if ctx.is_root:
        found = load_latest(store) if resume else None
        payload = found[1] if found else fresh
        problem = (misfit(model.variables, payload["model"], "model", split.saved_model_shapes())
                   or misfit(optimizer.variables, payload["optimizer"], "optimizer",
                             split.saved_optimizer_shapes(optimizer)))
        if problem:
            payload = {"misfit": problem}
    # Horovod: every rank starts from rank 0's weights, optimizer state and position, its own slices of them.
    payload = hvd.broadcast_object(payload, root_rank=0, name="initial_state")
    if "misfit" in payload:
        raise ConfigError(payload["misfit"])
    _assign(model.variables, split.local_model_arrays(payload["model"]))
    _assign(optimizer.variables, split.local_optimizer_arrays(optimizer, payload["optimizer"]), "optimizer")
    rngs = payload["rng"]
    if rngs and len(rngs) == ctx.size:
        set_rng_state(rngs[ctx.rank])
    return TrainState(**payload["state"])


def restore_on_root(store: CheckpointStore, model, optimizer, ctx: Context, resume: bool = True) -> ElasticStart:
    """Rank 0 alone loads its latest checkpoint (if any), with no collective: an elastic job's
    state reaches the other ranks in its first sync (see ElasticStart). RNG states are not handed
    back (the world may differ)."""
    if not optimizer.built:  # its variables exist before the elastic state copies them
        optimizer.build(model.trainable_variables)
    found = load_latest(store) if ctx.is_root and resume else None
    if not found:
        return ElasticStart()
    _, payload = found
    refusal = (misfit(model.variables, payload["model"], "model")
               or misfit(optimizer.variables, payload["optimizer"], "optimizer"))
    if refusal:
        return ElasticStart(refusal=refusal)
    _assign(model.variables, payload["model"])
    _assign(optimizer.variables, payload["optimizer"])
    return ElasticStart(**payload["state"])


def save_checkpoint(store: CheckpointStore, model, optimizer, state: TrainState, split=None) -> Path | None:
    """Called by every rank (the RNG states are gathered, BatchNorm statistics averaged, a
    tensor-parallel model's slices gathered with `split`); only rank 0 writes."""
    import horovod.tensorflow as hvd

    average_statistics(model, name="checkpoint.statistics")
    payload = root_payload(hvd, store, snapshot, rng_state, model, optimizer, state, split)
    if payload is None:
        return None

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)

    return store.save(state.step, write)


def checkpoint_store(cfg, ctx: Context) -> CheckpointStore:
    """Rank 0 writes `ckpt-<step>.pkl` files; other ranks never touch the disk."""
    return CheckpointStore(cfg.dir, cfg.keep, is_writer=ctx.is_root, suffix=SUFFIX)
