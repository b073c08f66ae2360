"""Pipelines and their checkpoints, whatever the framework: where a resumed run cuts its stages,
and how a file written before shards resumes.

A pipeline checkpoint is a folder of shards, as every strategy's (hvd_runtime.sharded); its index
keeps the cut (`cut`), so that `partition: time` resumes where it cut before (partition_to_resume).
A file written before shards holds {"stages": {index: part}, "state": TrainState fields, "rng":
per rank}: on restart every rank takes its own stage's part and its own RNG state back, at the
cut and pipeline shape that wrote it (restore_own_stage; the frameworks' legacy_checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable

from hvd_runtime.checkpoint import TrainState
from hvd_runtime.config import ConfigError


def _stage_starts(cut: dict) -> str:
    """Where stages 2.. start, as --parallel.partition takes it (block names)."""
    return ",".join(cut["names"][start] for start, _ in cut["bounds"][1:])


def partition_to_resume(partition, names: list[str], pieces: int, newest_cut: Callable[[], dict | None]):
    """The partition to cut a pipeline by: `partition` (as config.partition_spec gives it), except
    that `time` resumes at the newest checkpoint's stage starts when it cut these blocks into as
    many pieces; a fresh start, or a checkpoint of another model, times.

    Timing afresh would often cut elsewhere (stages a few tenths of a millisecond apart swap
    places between starts). `newest_cut` (the framework's checkpoint.newest_cut: rank 0 reads the
    checkpoint's index) is called for `time` only.
    """
    if partition != "time":
        return partition
    saved = newest_cut()
    if saved is None or saved["names"] != list(names) or len(saved["bounds"]) != pieces:
        return partition
    return [saved["names"][start] for start, _ in saved["bounds"][1:]]


def refuse_another_cut(payload: dict, plan, where: str) -> None:
    """Stop with one line when the checkpoint's stages were cut elsewhere than this run's.

    Each stage's part holds that stage's blocks only, so another cut (another `parallel.partition`,
    or `time`, which times the blocks afresh at every start) would find blocks missing from every
    part. Every rank has the same plan and payload, so every rank stops with the same line.
    Checkpoints written before the cut was kept are not checked here.
    """
    saved = payload.get("cut")
    if saved is None or plan is None:
        return
    mine = plan.cut()
    if saved["names"] != mine["names"] or len(saved["bounds"]) != len(mine["bounds"]) or saved == mine:
        return      # another model, or another count of stages or chunks: the part checks name those
    raise ConfigError(f"{where} was written by stages cut elsewhere (stages 2.. start at blocks "
                      f"{_stage_starts(saved)} there, {_stage_starts(mine)} here): resume with --parallel.partition "
                      f"{_stage_starts(saved)}, point --checkpoint.dir elsewhere, or pass --checkpoint.resume false")


def own_stage(payload: dict, place, where: str) -> dict:
    """This rank's stage part of a restored payload; refuses a checkpoint of another pipeline shape.

    The shape includes the chunks per rank: an interleaved stage holds other blocks (and its
    optimizer other slots) than a stage of the same index without chunks.
    """
    if "stages" not in payload or place.stage not in payload["stages"]:
        raise ValueError(f"{where} was not written by a {place.stages}-stage pipeline: "
                         "point --checkpoint.dir elsewhere, or pass --checkpoint.resume false")
    part = payload["stages"][place.stage]
    saved = part.get("chunks", 1)    # checkpoints from before interleaving: one chunk a stage
    if saved != place.chunks:
        def shape(chunks: int) -> str:
            return f"{chunks} chunks a stage (interleaved-1f1b)" if chunks > 1 else "one chunk a stage"

        raise ValueError(f"{where} was written by a pipeline of {shape(saved)}, this one has {shape(place.chunks)}: "
                         "resume with the parallel.schedule and parallel.chunks it was written with, point "
                         "--checkpoint.dir elsewhere, or pass --checkpoint.resume false")
    return part


def own_rng(payload: dict, rank: int, size: int):
    """This rank's saved RNG state, if the checkpoint came from a job of the same size; else None."""
    rngs = payload.get("rng")
    return rngs[rank] if rngs and len(rngs) == size else None


def restored_state(payload: dict) -> TrainState:
    return TrainState(**payload["state"])


def fitting_own_stage(hvd, payload: dict, place, where: str, misfit_of: Callable[[dict], str | None]) -> dict:
    """This rank's part of the checkpoint, once every rank has found that its own part fits.

    Only the rank holding a stage can tell whether that stage's part loads into it (another
    model.hidden, another dataset's classes, another optimizer's slots): `misfit_of(part)` says
    why not, or None. Each rank judges its own part and the verdicts are gathered, so every rank
    stops with the same config-error line instead of one rank failing while the others wait for
    it. A checkpoint of another pipeline shape is named before a misfit, since it explains the
    misfits of the other stages.
    """
    try:
        mine = own_stage(payload, place, where)
        problem = misfit_of(mine)
        verdict = None if problem is None else (1, problem)
    except ValueError as exc:  # this stage is not in the checkpoint
        mine, verdict = None, (0, str(exc))
    verdicts = [v for v in hvd.allgather_object(verdict, name="pp.restore_fits") if v is not None]
    if verdicts:
        raise ConfigError(min(verdicts)[1])
    return mine


def restore_own_stage(hvd, payload: dict | None, place, where: str, misfit_of: Callable[[dict], str | None],
                      load: Callable[[dict], None], set_rng_state: Callable, plan=None) -> TrainState:
    """Every rank calls, with the payload rank 0 read and broadcast (None: nothing to resume).

    Each rank checks that the checkpoint's stages were cut as this run's `plan` cuts them and its
    own stage's part fits (fitting_own_stage), loads it with `load(part)` (its framework's, a
    tensor-parallel stage taking its slices), and takes its RNG state back when the job has the
    size that wrote the checkpoint. Returns where training stands.
    """
    if payload is None:
        return TrainState()
    refuse_another_cut(payload, plan, where)
    load(fitting_own_stage(hvd, payload, place, where, misfit_of))
    rng = own_rng(payload, hvd.rank(), hvd.size())
    if rng is not None:
        set_rng_state(rng)
    return restored_state(payload)
