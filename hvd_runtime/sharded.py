"""The collective steps of a sharded checkpoint, whatever the framework: who writes, who publishes, who agrees.

    written = write_checkpoint(hvd, store, ctx, state, write_shard, rng, cut)  # every rank calls
    found = newest_on_root(store, ctx, resume, read_legacy)                     # rank 0 reads the index
    state = read_held(hvd, found, ctx, framework, wanted, load, ...)            # every rank its own rows

`hvd` is horovod.torch or horovod.tensorflow; the framework's checkpoint module says what a rank
holds (`write_shard`, `wanted`, `load`) and this module runs the same protocol for both: rank 0
stages a hidden folder and tells every rank where it is; the first replica's ranks each write
their shard there; rank 0 merges their descriptions into the index, written last, and publishes
the folder. A rank that cannot write makes every rank see the same failure, and the folder is
never published, so the previous checkpoint stays the newest (hvd_runtime.write_failures says
whether the run goes on). On resume rank 0 finds the newest
readable checkpoint, every rank reads its own rows of it, and all agree on one verdict before any
of them goes on.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

from hvd_runtime import watchdog
from hvd_runtime.checkpoint import CheckpointStore, TrainState, announce_resume, misfit_message, state_fields
from hvd_runtime.config import ConfigError
from hvd_runtime.shards import (INDEX, DamagedCheckpoint, ShardReader, index_misfit, merge_index, read_index,
                                write_json)


class NonFiniteTensor(ValueError):
    """A tensor a rank was about to checkpoint holds NaN or inf: no checkpoint ever does."""


def shard_description(path: Path, tensors: dict, values: dict) -> dict:
    """A rank's shard, just written to `path`, made durable and described for the index: its
    size, and the tensors and other values it holds (`tensors`: name -> key and Placement)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": path.stat().st_size, "tensors": tensors, "values": values}


def write_checkpoint(hvd, store: CheckpointStore, ctx, state, write_shard: Callable[[Path, bool], dict], rng,
                     cut: dict | None, last: bool = False, every_replica: bool = False) -> bool:
    """Every rank calls: the first replica's ranks each `write_shard(folder, write_whole)` (its file's
    description, for the index; `write_whole`: this rank also writes the tensors every rank of its
    tensor-parallel group holds whole), rank 0 the index, last. `rng` is this rank's RNG state,
    `cut` where a pipeline or model-split cut the model (None elsewhere), `last`: the run's final
    checkpoint; `every_replica`: every replica writes (ZeRO: each holds its own rows), the first
    one the whole tensors. Returns, on
    every rank alike, whether the checkpoint was written; one that was not goes to the store's
    failure count (hvd_runtime.write_failures), which warns, or stops the run on every rank. A
    rank that cannot find the staging folder cannot see --checkpoint.dir, which no retry mends:
    every rank raises ConfigError at the first checkpoint."""
    watchdog.beat(f"checkpoint at step {state.step}", allowance=True)
    rngs = hvd.allgather_object(rng, name="checkpoint.rng")
    staging = None
    if store.is_writer:
        try:
            staging = str(store.staging(state.step).resolve())  # rank 0's folder, wherever a rank runs
        except OSError as exc:
            staging = OSError(f"{_not_written(store, state.step)}: cannot make {store.directory}: {exc}")
    staging = hvd.broadcast_object(staging, root_rank=0, name="checkpoint.staging")
    if isinstance(staging, Exception):
        return _failed(store, str(staging), state.step, last)
    description = None
    if ctx.data_rank == 0 or every_replica:
        coords = ctx.coords
        try:
            if not Path(staging).is_dir():   # rank 0 made it: this rank sees another file system
                description = {"error": f"rank {ctx.rank} cannot see {staging}, which rank 0 made: every rank "
                                        "must see --checkpoint.dir (a shared volume)", "lasting": True}
            else:
                description = write_shard(Path(staging), ctx.data_rank == 0 and (coords is None or coords.tp == 0))
        except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
            description = {"error": f"rank {ctx.rank} could not write its shard in {staging} ({exc})"}
        except NonFiniteTensor as exc:
            description = {"error": f"rank {ctx.rank}'s {exc}, and a checkpoint never holds a non-finite value"}
    shards = [d for d in hvd.allgather_object(description, name="checkpoint.shards") if d is not None]
    failed = next((d for d in shards if d.get("lasting")), None) or next((d for d in shards if "error" in d), None)
    outcome = None
    if store.is_writer:
        try:
            if failed:
                raise OSError(failed["error"])
            index = merge_index(shards, step=state.step, state=state_fields(state), rng=rngs, cut=cut)
            write_json(Path(staging) / INDEX, index)
            store.publish(state.step, Path(staging))
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            outcome = f"{_not_written(store, state.step)}: {exc}"
    outcome = hvd.broadcast_object(outcome, root_rank=0, name="checkpoint.outcome")
    if outcome and failed and failed.get("lasting"):
        raise ConfigError(outcome)
    if outcome:
        return _failed(store, outcome, state.step, last)
    store.failures.written()
    return True


def _not_written(store: CheckpointStore, step: int) -> str:
    """What a failed write leaves, as rank 0 (the store's writer) sees the folder."""
    before = "the previous one stays the newest" if store.paths() else "and there is no checkpoint before it"
    return f"checkpoint {step} was not written, {before}"


def _failed(store: CheckpointStore, reason: str, step: int, last: bool) -> bool:
    store.failures.failed(reason, step, last, store.directory, say=store.is_writer)
    return False


def read_newest(store: CheckpointStore, read_legacy: Callable[[Path], dict]):
    """Rank 0: (path, index) of the newest sharded checkpoint whose files are all there, or (path,
    payload) of a checkpoint written before shards (`read_legacy` reads one); None if there is
    none. Each damaged one is warned about and the previous one tried; when none can be read, a
    ConfigError names the newest's problem (training afresh would prune them)."""
    problems = []

    def read(path: Path):
        try:
            return read_index(path) if path.is_dir() else read_legacy(path)
        except Exception as exc:  # a corrupt file can raise almost anything from the unpickler
            problems.append(f"{path.name}: {exc}")
            raise

    found = store.load_latest(read)
    if found is None and problems:
        raise ConfigError(f"no checkpoint in {store.directory} can be read (the newest, {problems[0]}): move them "
                          "aside or pass --checkpoint.resume false to start over")
    return found


def newest_on_root(store: CheckpointStore, ctx, resume: bool, read_legacy: Callable[[Path], dict]):
    """Rank 0's read_newest (announced), or the ConfigError it raised, for rank 0 to hand on; None elsewhere."""
    if not (ctx.is_root and resume):
        return None
    try:
        found = read_newest(store, read_legacy)
    except ConfigError as exc:
        return exc
    if found is not None:
        announce_resume(*found)
    return found


def newest_cut(hvd, store: CheckpointStore, ctx, resume: bool, read_legacy: Callable[[Path], dict]) -> dict | None:
    """Where the newest checkpoint's pipeline stages were cut (rank 0 reads it, every rank gets it);
    None when there is none to resume. Read before the stages are built, so that `partition: time`
    cuts a resumed run where it was cut before."""
    cut = None
    if ctx.is_root and resume:
        try:
            found = read_newest(store, read_legacy)
        except ConfigError:
            found = None       # the restore refuses it, on every rank
        cut = found[1].get("cut") if found else None
    return hvd.broadcast_object(cut, root_rank=0, name="pp.newest_cut")


def read_held(hvd, found, ctx, framework: str, wanted: Callable[[], dict], load: Callable[[ShardReader], None],
              read_errors: tuple, legacy: Callable[[dict | None], TrainState],
              set_rng_state: Callable[[object], None]) -> TrainState:
    """Every rank calls, `found` being rank 0's newest_on_root: each rank loads the rows it holds of
    the checkpoint (`load(reader)`) once every rank's tensors (`wanted()`: `model/<name>` -> whole
    shape) are found to be the checkpoint's; a file written before shards goes to `legacy` (with
    rank 0's payload). One verdict for all: a misfit or a file a rank cannot read (`read_errors`)
    stops every rank with the same ConfigError."""
    where = found if found is None or isinstance(found, ConfigError) else (
        str(found[0].resolve()), found[1] if found[0].is_dir() else None)
    where = hvd.broadcast_object(where, root_rank=0, name="checkpoint.newest")
    if isinstance(where, ConfigError):
        raise where
    if where is None:
        return TrainState()
    path, index = Path(where[0]), where[1]
    if index is None:
        return legacy(found[1] if ctx.is_root else None)
    verdict = None
    try:
        names = hvd.allgather_object(wanted(), name="checkpoint.names")
        misfit = index_misfit(index, {k: v for mine in names for k, v in mine.items()})
        if misfit:
            verdict = misfit_message(misfit)
        else:
            load(ShardReader(path, index, framework))
    except (DamagedCheckpoint, OSError, *read_errors) as exc:
        verdict = (f"the checkpoint {path} cannot be read on rank {ctx.rank} ({exc}): every rank must see "
                   "--checkpoint.dir (a shared volume); move the damaged folder aside to resume from the "
                   "previous one, or pass --checkpoint.resume false")
    verdicts = [v for v in hvd.allgather_object(verdict, name="checkpoint.fits") if v]
    if verdicts:
        raise ConfigError(verdicts[0])
    rngs = index.get("rng")
    if rngs and len(rngs) == ctx.size:
        set_rng_state(rngs[ctx.rank])
    return TrainState(**index["state"])
