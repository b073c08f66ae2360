"""Checkpoints for every strategy, in TensorFlow / Keras 3: each rank writes what it holds, and reads what it will hold.

    checkpoints = checkpoint_store(cfg.checkpoint, ctx)
    state = restore_checkpoint(checkpoints, parallel, ctx, resume=cfg.checkpoint.resume)
    save_checkpoint(checkpoints, parallel, state, ctx)          # every rank calls

The format and the protocol are PyTorch's (hvd_runtime.shards, hvd_runtime.sharded): a folder of
safetensors shards, one per rank of the first replica, each holding that rank's variables and
slices under their names in the whole model, and an index rank 0 writes last. A checkpoint thus
resumes at any layout, and a job killed while writing leaves the previous one the newest.

Variables are stored under their names in the whole model (hvd_runtime.tf.names: `2.qkv.kernel`),
so a tensor-parallel slice has the name of the unsplit variable it is cut from. An optimizer slot made
for a variable (momentum, Adam's moments; Keras names it after the variable's path) is
`optimizer/<name>/<slot>`, split with it; the optimizer's own (its iteration count) is
`optimizer/<its name>`.

What an exact resume needs besides: the position in the epoch, and each rank's Python and NumPy
generator states with its Dropout layers' seed states (integer variables, each rank's own),
handed back to the same rank when the job has the same size.

Where every rank holds the whole model (data parallelism, model-split, elastic) rank 0 alone
reads it and the variables are broadcast, so only rank 0 needs to see the folder; elsewhere each
rank reads its own rows. Under ZeRO (horovod.zero, hvd_runtime.tf.zero) every replica writes and
reads its rows of the optimizer slots, which are built over the rows it steps. Checkpoints
written before shards (one `ckpt-<step>.pkl`) still resume at the layout that wrote them
(hvd_runtime.tf.legacy_checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import SafetensorError

from hvd_runtime import sharded
from hvd_runtime.checkpoint import (CheckpointStore, ElasticStart, TrainState, host_rng_state, misfit_message,
                                    set_host_rng_state, state_fields)
from hvd_runtime.config import ConfigError
from hvd_runtime.shards import MODEL, OPTIMIZER, DamagedCheckpoint, Placement, ShardReader, index_misfit, shard_name
from hvd_runtime.tf.broadcast import broadcast_variables
from hvd_runtime.tf.buffers import average_statistics
from hvd_runtime.tf.context import Context
from hvd_runtime.tf.legacy_checkpoint import read_legacy, restore_legacy, whole_legacy
from hvd_runtime.tf.names import is_state, whole_names

__all__ = ["checkpoint_store", "held_variables", "newest_cut", "restore_checkpoint", "restore_on_root",
           "save_checkpoint", "shared_variables"]

# -- what a checkpoint holds -------------------------------------------------------------------------

def shared_variables(model, optimizer, local_variables=()) -> list:
    """What every rank holding the whole model must hold identically: its float variables (not
    `local_variables`, each rank's own) and all of the optimizer's. Integer variables are Dropout's
    seed states: each rank keeps its own, so dropout masks differ across ranks."""
    local = {id(v) for v in local_variables}
    return [v for v in model.variables if is_state(v) and id(v) not in local] + list(optimizer.variables)


def _model_entries(module, slices) -> list[tuple[object, str, Placement]]:
    """(variable, `model/<name>`, where it sits in the whole variable) for what `module` holds."""
    names, cuts = whole_names(module), (slices.by_id if slices is not None else {})
    entries, seen = [], set()
    for v in module.variables:
        if id(v) not in names or id(v) in seen:
            continue
        seen.add(id(v))
        cut = cuts.get(id(v))
        at = Placement.slice(cut.shape, cut.axis, cut.index.tolist()) if cut is not None else Placement.whole(v.shape)
        entries.append((v, MODEL + names[id(v)], at))
    return entries


def _optimizer_entries(optimizer, model_entries, zero=None) -> list[tuple[object, str, Placement]]:
    """The optimizer's variables: each slot under its variable's name, split with it when shaped like
    it; under ZeRO (`zero`) a slot of a variable's rows is those rows of it."""
    rows = zero.rows_by_variable() if zero is not None else {}
    stepped = [(rows[id(v)][0], at.part(0, *rows[id(v)][1])) if id(v) in rows else (v, at)
               for v, _, at in model_entries]
    prefixes = sorted(((s.path.replace("/", "_") + "_", name.removeprefix(MODEL), at, tuple(s.shape))
                       for (s, at), (_, name, _) in zip(stepped, model_entries)), key=lambda item: -len(item[0]))
    entries, taken = [], set()
    for v in optimizer.variables:
        match = next((p for p in prefixes if v.name.startswith(p[0])), None)
        if match is None:
            name, at = OPTIMIZER + v.name, Placement.whole(v.shape)
        else:
            prefix, owner, owner_at, local = match
            like = tuple(v.shape) == local and len(local) > 0
            name, at = f"{OPTIMIZER}{owner}/{v.name[len(prefix):]}", owner_at if like else Placement.whole(v.shape)
        while name in taken:   # two optimizer variables of one name (a wrapper's and its inner one's)
            name += "'"
        taken.add(name)
        entries.append((v, name, at))
    return entries


def held_variables(module, optimizer, slices=None, zero=None) -> list[tuple[object, str, Placement]]:
    """Everything this rank checkpoints: (variable, `model/<name>` or `optimizer/...`, Placement)."""
    entries = _model_entries(module, slices)
    return entries if optimizer is None else entries + _optimizer_entries(optimizer, entries, zero)


def rng_state(module) -> dict:
    """This rank's Python and NumPy generators and its Dropout layers' seed states, as JSON values."""
    return {**host_rng_state(), "seeds": [v.numpy().tolist() for v in module.variables if not is_state(v)]}


def set_rng_state(state: dict, module) -> None:
    set_host_rng_state(state)
    seeds = [v for v in module.variables if not is_state(v)]
    if len(seeds) == len(state.get("seeds", [])):
        for v, value in zip(seeds, state["seeds"]):
            v.assign(np.asarray(value, dtype=v.dtype))


# -- writing ----------------------------------------------------------------------------------------

def _write_shard(folder: Path, rank: int, held: list, write_whole: bool) -> dict:
    """Write this rank's file; return its description for the index. Whole variables are written
    by one rank of a tensor-parallel group (`write_whole`)."""
    from safetensors.numpy import save_file

    tensors, described = {}, {}
    for v, name, at in held:
        if at.dim is None and not write_whole:
            continue
        tensors[name] = np.array(v.numpy(), order="C")   # (ascontiguousarray makes a scalar 1-d)
        described[name] = {"key": name, **at.to_json()}
    bad = next((key for key, a in tensors.items() if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all()),
               None)
    if bad is not None:
        raise sharded.NonFiniteTensor(f"{bad} holds NaN or inf")
    path = folder / shard_name(rank)
    save_file(tensors, str(path))
    return sharded.shard_description(path, described, {})


def save_checkpoint(store: CheckpointStore, parallel, state, ctx: Context, last: bool = False) -> bool:
    """Every rank calls: the first replica's ranks each write their shard, rank 0 the index, last
    (hvd_runtime.sharded.write_checkpoint); BatchNorm statistics are first averaged over the
    replicas; `last`: the run's final one. Returns, on every rank alike, whether it was written: a
    rank that fails to write fails it on every rank, and the previous checkpoint stays the newest;
    the run goes on or stops as `checkpoint.max_failures` says (hvd_runtime.write_failures)."""
    import horovod.tensorflow as hvd

    module, optimizer = parallel.module, parallel.optimizer
    if ctx.dp_set is not None:
        average_statistics(module, process_set=ctx.dp_set, name="checkpoint.statistics")

    zero = parallel.zero

    def write_shard(folder: Path, write_whole: bool) -> dict:
        return _write_shard(folder, ctx.rank, held_variables(module, optimizer, parallel.slices, zero), write_whole)

    return sharded.write_checkpoint(hvd, store, ctx, state, write_shard, rng_state(module),
                                    parallel.plan.cut() if parallel.plan else None, last,
                                    every_replica=zero is not None)


# -- reading ----------------------------------------------------------------------------------------

def _built(module, optimizer, zero=None) -> None:
    """The optimizer's variables exist before they are read into or broadcast (under ZeRO: over the
    rows this rank steps)."""
    if optimizer is not None and not optimizer.built:
        optimizer.build(zero.stepped if zero is not None else module.trainable_variables)


def wanted_shapes(module, slices=None) -> dict[str, tuple[int, ...]]:
    """`model/<name>` of every variable this rank holds, with its whole shape."""
    return {name: at.shape for _, name, at in _model_entries(module, slices)}


def _load_held(reader: ShardReader, module, optimizer, slices=None, zero=None) -> None:
    """Assign this rank's variables (and optimizer slots) their rows of the checkpoint."""
    saved = reader.index["tensors"]
    for v, name, at in held_variables(module, optimizer, slices, zero):
        if name not in saved:
            raise DamagedCheckpoint(f"it holds no {name} (written with another optimizer?)")
        if tuple(saved[name]["shape"]) != at.shape:
            raise DamagedCheckpoint(f"{name} is {tuple(saved[name]['shape'])} there, {at.shape} here "
                                    "(written with another optimizer?)")
        v.assign(reader.read(name, at).astype(v.dtype, copy=False))
    reader.close()


def _newest_on_root(store: CheckpointStore, ctx: Context, resume: bool):
    return sharded.newest_on_root(store, ctx, resume, read_legacy)


def _whole_on_root(found, module, optimizer) -> dict:
    """Rank 0, where every rank holds the whole model: load the newest checkpoint into `module`;
    what it then broadcasts besides the variables ({"misfit": the line} if it does not fit)."""
    if isinstance(found, ConfigError):
        return {"misfit": str(found)}
    if found is None:
        return {"state": state_fields(TrainState()), "rng": None}
    path, read = found
    if not path.is_dir():
        return whole_legacy(read, module, optimizer)
    misfit = index_misfit(read, wanted_shapes(module))
    if misfit:
        return {"misfit": misfit_message(misfit)}
    try:
        _load_held(ShardReader(path, read, "np"), module, optimizer)
    except (DamagedCheckpoint, OSError, SafetensorError) as exc:
        return {"misfit": f"the checkpoint {path} cannot be read ({exc}): move it aside to resume from the "
                          "previous one, or pass --checkpoint.resume false"}
    return {"state": read["state"], "rng": read["rng"]}


def restore_checkpoint(store: CheckpointStore, parallel, ctx: Context, resume: bool = True,
                       local_variables=()) -> TrainState:
    """Every rank calls: load the newest checkpoint (if any, and `resume`) into what this rank
    holds; return where training stands. A checkpoint that does not fit the model stops every
    rank with the same ConfigError, before anything is written. Where every rank holds the whole
    model, all begin from rank 0's variables (`local_variables` excepted: each rank's own)."""
    import horovod.tensorflow as hvd

    module, optimizer, zero = parallel.module, parallel.optimizer, parallel.zero
    _built(module, optimizer, zero)
    found = _newest_on_root(store, ctx, resume)
    if zero is not None:   # every rank holds the whole model, its own rows of the optimizer state
        # Horovod: every rank starts from rank 0's weights, then reads its rows of a checkpoint, if any
        broadcast_variables([v.value for v in module.variables if is_state(v)], root_rank=0)
    if ctx.coords is not None or zero is not None:
        state = sharded.read_held(hvd, found, ctx, "np", lambda: wanted_shapes(module, parallel.slices),
                                  lambda reader: _load_held(reader, module, optimizer, parallel.slices, zero),
                                  (SafetensorError,), lambda payload: restore_legacy(payload, parallel, ctx),
                                  lambda state: set_rng_state(state, module))
        if zero is not None:
            zero.take_rows()
        return state
    meta = _whole_on_root(found, module, optimizer) if ctx.is_root else None
    meta = hvd.broadcast_object(meta, root_rank=0, name="initial_state")
    if "misfit" in meta:  # every rank stops with rank 0's reason, none waits for the others
        raise ConfigError(meta["misfit"])
    # Horovod: every rank starts from rank 0's weights, optimizer state and position.
    broadcast_variables([v.value for v in shared_variables(module, optimizer, local_variables)], root_rank=0)
    rngs = meta["rng"]
    if rngs and len(rngs) == ctx.size:
        set_rng_state(rngs[ctx.rank], module)
    return TrainState(**meta["state"])


def restore_on_root(store: CheckpointStore, model, optimizer, ctx: Context, resume: bool = True) -> ElasticStart:
    """Rank 0 alone loads its latest checkpoint (if any), with no collective: an elastic job's
    state reaches the other ranks in its first sync (see ElasticStart). RNG states are not handed
    back (the world may differ)."""
    _built(model, optimizer)
    if not ctx.is_root:
        return ElasticStart()
    meta = _whole_on_root(_newest_on_root(store, ctx, resume), model, optimizer)
    if "misfit" in meta:
        return ElasticStart(refusal=meta["misfit"])
    return ElasticStart(**meta["state"])


def newest_cut(checkpoint_cfg, ctx) -> dict | None:
    """Where the newest checkpoint's pipeline stages were cut (rank 0 reads its index, every rank
    gets it); None when there is none to resume. Read before the stages are built."""
    import horovod.tensorflow as hvd

    return sharded.newest_cut(hvd, checkpoint_store(checkpoint_cfg, ctx), ctx, checkpoint_cfg.resume, read_legacy)


def checkpoint_store(cfg, ctx: Context) -> CheckpointStore:
    """Rank 0 manages the folder (stages, publishes, prunes); the first replica's ranks write shards
    into it. Checkpoints from before shards (`ckpt-<step>.pkl`) are still found."""
    return CheckpointStore(cfg.dir, cfg.keep, is_writer=ctx.is_root, suffix="pkl", max_failures=cfg.max_failures)
