"""Checkpoints for every strategy, in PyTorch: each rank writes what it holds, and reads what it will hold.

    checkpoints = checkpoint_store(cfg.checkpoint, ctx)
    state = restore_checkpoint(checkpoints, parallel, ctx, resume=cfg.checkpoint.resume)
    save_checkpoint(checkpoints, parallel, state, ctx)          # every rank calls

A checkpoint is a folder of shards (hvd_runtime.shards): the ranks of the first replica each
write their model's and optimizer's tensors (a pipeline stage's, a tensor-parallel slice's) under
their names in the whole model, with where each slice sits in the whole tensor; rank 0 writes
the index last. Under ZeRO (horovod.zero) every replica writes its rows of the optimizer state
(and under ZeRO 3 of the parameters), the first the tensors every replica holds whole. No rank
gathers another's tensors, and a checkpoint resumes at any layout: each rank reads from the
shards only the rows of the tensors it holds now, so a job saved at pp 2 x tp 2 resumes unsplit,
at another tp, cut elsewhere, and back.

A checkpoint holds what an exact resume needs: model (BatchNorm statistics first averaged over
the replicas), optimizer slots, the position in the epoch (in samples, so a resized job carries
on too), and each rank's RNG state, handed back to the same rank when the job has the same size.
The LR schedule is a function of the step, so it needs no state of its own.

Where every rank holds the whole model and its optimizer (data parallelism, model-split) rank 0
alone reads and broadcasts what it read, as the start of a data-parallel job always has: the
ranks then begin bit-identical, and only rank 0 needs to see the checkpoint folder. Elsewhere every rank reads
its own slices, so the folder must be one every rank mounts (a ReadWriteMany volume, a shared
file system). Checkpoints written before shards (one `ckpt-<step>.pt`) still resume
(hvd_runtime.torch.legacy_checkpoint); every new one is a folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from hvd_runtime import sharded
from hvd_runtime.checkpoint import CheckpointStore, ElasticStart, TrainState, misfit_message, state_fields
from hvd_runtime.config import ConfigError
from hvd_runtime.shards import MODEL, OPTIMIZER, Placement, ShardReader, index_misfit, shard_name
from hvd_runtime.sharded import (NonFiniteTensor, newest_on_root, read_held, shard_description,
                                 write_checkpoint)
from hvd_runtime.torch.buffers import average_buffers
from hvd_runtime.torch.context import Context
from hvd_runtime.torch.legacy_checkpoint import legacy_payload, restore_legacy
from hvd_runtime.torch.rng import rng_state, set_rng_state
from hvd_runtime.torch.zero import ZeroOptimizer, rows_by_parameter

# -- what this rank holds, by whole-model name ----------------------------------------------------

def _model_placements(module: nn.Module, slices) -> dict[str, Placement]:
    """Where each of the module's state_dict entries sits in the whole model's (a tensor-parallel
    slice, ZeRO 3's rows, or whole)."""
    placements = {}
    rows = rows_by_parameter(module)
    for name, t in module.state_dict(keep_vars=True).items():
        held = rows.get(id(t))
        shape = list(t.shape if held is None else held.shape)   # as tensor parallelism holds it
        cut = slices.by_name.get(name) if slices is not None else None
        if cut is not None:
            shape[cut.dim] = cut.size
            at = Placement.slice(shape, cut.dim, cut.index.tolist())
        else:
            at = Placement.whole(shape)
        placements[name] = at if held is None else at.part(held.dim, *held.rows)
    return placements


def _slot_placement(param_at: Placement, shape, like_param: bool) -> Placement:
    """An optimizer slot shaped like its parameter (momentum, Adam's moments: `like_param`) is
    split with it; any other (a step count) is whole, of `shape`."""
    return param_at if like_param and len(shape) > 0 else Placement.whole(shape)


def _parameters(module: nn.Module, optimizer, placements: dict[str, Placement]
                ) -> list[tuple[str, torch.Tensor, Placement]]:
    """The tensors the optimizer steps in its own order, with their names in the whole model (the
    module's state_dict keys: a model-split's are the whole model's, not its attributes') and
    where they sit there (ZeRO's: this rank's rows of a parameter the model holds whole)."""
    if isinstance(optimizer, ZeroOptimizer):   # stages 1 and 2 step rows of a parameter held whole
        return [(s.name, s.stepped, placements[s.name] if s.stepped is s.param or s.rows is None
                 else placements[s.name].part(s.dim, *s.rows)) for s in optimizer.shards]
    names: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        names.setdefault(id(t), name)   # a tied parameter: its first name
    return [(names[id(p)], p, placements[names[id(p)]]) for group in optimizer.param_groups for p in group["params"]]


def held_tensors(module: nn.Module, optimizer, slices=None) -> dict[str, tuple[object, Placement | None]]:
    """Everything this rank checkpoints: `model/<name>` and `optimizer/<parameter>/<slot>`, each a
    tensor with its Placement, or a value that is not a tensor (Placement None)."""
    placements = _model_placements(module, slices)
    held: dict[str, tuple[object, Placement | None]] = {
        MODEL + name: (t, placements[name]) for name, t in module.state_dict().items()}
    if optimizer is None:
        return held
    for name, param, param_at in _parameters(module, optimizer, placements):
        for slot, value in optimizer.state.get(param, {}).items():
            at = (_slot_placement(param_at, value.shape, value.shape == param.shape)
                  if isinstance(value, torch.Tensor) else None)
            held[f"{OPTIMIZER}{name}/{slot}"] = (value, at)
    return held


# -- writing ----------------------------------------------------------------------------------------

def _write_shard(folder: Path, rank: int, held: dict, write_whole: bool, model: bool = True) -> dict:
    """Write this rank's file; return its description for the index. Whole tensors are written by
    one rank of a tensor-parallel group (`write_whole`); tensors sharing storage (tied weights) once;
    the model's only where `model` (a ZeRO 1 or 2 replica past the first writes its rows of the
    optimizer state alone)."""
    from safetensors.torch import save_file

    tensors, described, values, keys = {}, {}, {}, {}
    for entry, (value, at) in held.items():
        if at is None:
            values[entry] = value
            continue
        if at.dim is None and not write_whole or entry.startswith(MODEL) and not model:
            continue
        t = value.detach()
        same = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        key = keys.setdefault(same, entry)
        if key == entry:
            tensors[key] = t.cpu().contiguous()
        described[entry] = {"key": key, **at.to_json()}
    bad = next((key for key, t in tensors.items() if t.is_floating_point() and not _finite(t)), None)
    if bad is not None:
        raise NonFiniteTensor(f"{bad} holds NaN or inf")
    path = folder / shard_name(rank)
    save_file(tensors, path)
    return shard_description(path, described, values)


def _finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN and no inf, through two masks of bools: torch.isfinite would copy
    the tensor whole (its abs) on the way."""
    return not bool(torch.isnan(t).any()) and not bool(torch.isinf(t).any())


def save_checkpoint(store: CheckpointStore, parallel, state, ctx: Context, last: bool = False) -> bool:
    """Every rank calls: the first replica's ranks each write their shard, rank 0 the index, last
    (hvd_runtime.sharded.write_checkpoint); `last`: the run's final one. Returns, on every rank
    alike, whether it was written: a rank that fails to write (a full disk) fails it on every
    rank, the folder is never published and the previous checkpoint stays the newest; the run
    goes on or stops as `checkpoint.max_failures` says (hvd_runtime.write_failures).
    """
    import horovod.torch as hvd

    module, optimizer = parallel.module, parallel.optimizer
    if ctx.dp_set is not None:
        average_buffers(module, process_set=ctx.dp_set, name="checkpoint.buffers")

    zero = optimizer.stage if isinstance(optimizer, ZeroOptimizer) else 0

    def write_shard(folder: Path, write_whole: bool) -> dict:
        return _write_shard(folder, ctx.rank, held_tensors(module, optimizer, parallel.slices), write_whole,
                            model=zero not in (1, 2) or ctx.data_rank == 0)

    return write_checkpoint(hvd, store, ctx, state, write_shard, rng_state(),
                            parallel.plan.cut() if parallel.plan else None, last,
                            every_replica=isinstance(optimizer, ZeroOptimizer))


# -- reading ----------------------------------------------------------------------------------------

def wanted_shapes(module: nn.Module, slices=None) -> dict[str, tuple[int, ...]]:
    """`model/<name>` of every tensor this rank holds, with its whole shape."""
    return {MODEL + name: at.shape for name, at in _model_placements(module, slices).items()}


def _load_held(reader: ShardReader, module: nn.Module, optimizer, slices=None) -> None:
    """Load this rank's tensors (and optimizer slots) from the checkpoint, as this rank holds them."""
    placements = _model_placements(module, slices)
    module.load_state_dict({name: reader.read(MODEL + name, at) for name, at in placements.items()})
    if optimizer is None:
        return
    tensors, values = reader.index["tensors"], reader.index["values"]
    state = {}
    for i, (name, _, param_at) in enumerate(_parameters(module, optimizer, placements)):
        prefix = f"{OPTIMIZER}{name}/"
        slots = {entry[len(prefix):]: value for entry, value in values.items() if entry.startswith(prefix)}
        for entry, saved in tensors.items():
            if entry.startswith(prefix):
                like_param = tuple(saved["shape"]) == param_at.shape
                slots[entry[len(prefix):]] = reader.read(entry, _slot_placement(param_at, saved["shape"], like_param))
        if slots:
            state[i] = slots
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def _read_legacy(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _newest_on_root(store: CheckpointStore, ctx: Context, resume: bool):
    return newest_on_root(store, ctx, resume, _read_legacy)


def _whole_payload(folder: Path, index: dict, module: nn.Module, optimizer) -> dict:
    """What rank 0 broadcasts where every rank holds the whole model: the state it loaded."""
    misfit = index_misfit(index, wanted_shapes(module))
    if misfit:
        return {"misfit": misfit_message(misfit)}
    _load_held(ShardReader(folder, index), module, optimizer)
    return {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "state": index["state"],
            "rng": index["rng"]}


def restore_checkpoint(store: CheckpointStore, parallel, ctx: Context, resume: bool = True) -> TrainState:
    """Every rank calls: load the newest checkpoint (if any, and `resume`) into what this rank
    holds; return where training stands. A checkpoint that does not fit the model stops every
    rank with the same ConfigError, before anything is written."""
    import horovod.torch as hvd

    found = _newest_on_root(store, ctx, resume)
    if ctx.coords is None and not isinstance(parallel.optimizer, ZeroOptimizer):
        return _restore_whole(found, parallel, ctx)
    return read_held(hvd, found, ctx, "pt", lambda: wanted_shapes(parallel.module, parallel.slices),
                     lambda reader: _load_held(reader, parallel.module, parallel.optimizer, parallel.slices),
                     (SafetensorError,), lambda payload: restore_legacy(payload, parallel, ctx), set_rng_state)


def _restore_whole(found, parallel, ctx: Context) -> TrainState:
    """Every rank holds the whole model: rank 0 reads, every rank starts from what it broadcasts."""
    import horovod.torch as hvd

    module, optimizer = parallel.module, parallel.optimizer
    payload = None
    if ctx.is_root:
        if isinstance(found, ConfigError):
            payload = {"misfit": str(found)}
        elif found is None:
            payload = {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                       "state": state_fields(TrainState()), "rng": None}
        elif found[0].is_dir():
            payload = _whole_payload(found[0], found[1], module, optimizer)
        else:
            payload = legacy_payload(found[1], module)
    # Horovod: every rank starts from rank 0's weights, optimizer state and position.
    payload = hvd.broadcast_object(payload, root_rank=0, name="initial_state")
    if "misfit" in payload:  # every rank stops with rank 0's reason, none waits for the others
        raise ConfigError(payload["misfit"])
    module.load_state_dict(payload["model"])
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
    found = _newest_on_root(store, ctx, resume)
    if isinstance(found, ConfigError):
        return ElasticStart(refusal=str(found))
    if found is None:
        return ElasticStart()
    payload = _whole_payload(found[0], found[1], model, optimizer) if found[0].is_dir() \
        else legacy_payload(found[1], model)
    if "misfit" in payload:
        return ElasticStart(refusal=payload["misfit"])
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    return ElasticStart(**payload["state"])


def newest_cut(checkpoint_cfg, ctx) -> dict | None:
    """Where the newest checkpoint's pipeline stages were cut (rank 0 reads its index, every rank
    gets it); None when there is none to resume. Read before the stages are built."""
    import horovod.torch as hvd

    return sharded.newest_cut(hvd, checkpoint_store(checkpoint_cfg, ctx), ctx, checkpoint_cfg.resume, _read_legacy)


def checkpoint_store(cfg, ctx: Context) -> CheckpointStore:
    """Rank 0 manages the folder (stages, publishes, prunes); the first replica's ranks write shards into it."""
    return CheckpointStore(cfg.dir, cfg.keep, is_writer=ctx.is_root, max_failures=cfg.max_failures)
