"""Checkpoints written before shards still resume: one `ckpt-<step>.pkl` file, from rank 0.

Such a file holds the model's variables and the optimizer's as two lists, in their order: the
whole model's (data parallelism, model-split; under tensor parallelism the whole model's,
gathered), or for a pipeline each stage's, as that stage held them. It resumes at the layout it
was written at: any tp for the unsplit lists, the same stages cut at the same blocks for a
pipeline. Rank 0 reads it; each rank keeps its part. The first checkpoint the resumed job writes
is a folder of shards (hvd_runtime.tf.checkpoint), which resumes at any layout.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from hvd_runtime.checkpoint import TrainState, misfit_message, set_host_rng_state
from hvd_runtime.config import ConfigError
from hvd_runtime.pipeline.checkpoint import restore_own_stage


PIPELINE_FILE = ("the newest checkpoint was written by a pipeline before checkpoints were sharded: resume it with "
                 "--strategy pipeline as it was written, point --checkpoint.dir elsewhere, or pass "
                 "--checkpoint.resume false")


def read_legacy(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def misfit(variables, arrays, what: str, shapes=None) -> str | None:
    """Why saved arrays cannot be assigned to these variables, as the user's config error; None if they fit.

    shapes: the variables' shapes in the file, where they differ from their own (a split model's).
    """
    if len(variables) != len(arrays):
        return misfit_message(f"{len(arrays)} {what} arrays saved, {len(variables)} variables now")
    for v, a, shape in zip(variables, arrays, shapes or [tuple(v.shape) for v in variables]):
        if tuple(shape) != tuple(a.shape):
            return misfit_message(f"{v.path}: {tuple(a.shape)} saved, {tuple(shape)} now")
    return None


def _assign(variables, arrays) -> None:
    for v, a in zip(variables, arrays):
        v.assign(a)


def whole_legacy(payload: dict, module, optimizer) -> dict:
    """Rank 0, every rank holding the whole model: the file's lists assigned to `module` and the
    optimizer; what rank 0 then broadcasts besides the variables, or {"misfit": the line}."""
    if "stages" in payload:
        return {"misfit": PIPELINE_FILE}
    problem = (misfit(module.variables, payload["model"], "model")
               or misfit(optimizer.variables, payload["optimizer"], "optimizer"))
    if problem:
        return {"misfit": problem}
    _assign(module.variables, payload["model"])
    _assign(optimizer.variables, payload["optimizer"])
    return {"state": payload["state"], "rng": payload["rng"]}


def restore_legacy(payload: dict | None, parallel, ctx) -> TrainState:
    """Every rank calls, `payload` read on rank 0: a tensor-parallel model takes its slices of the
    unsplit lists, a pipeline stage its own stage's part (the cut checked first)."""
    import horovod.tensorflow as hvd

    payload = hvd.broadcast_object(payload, root_rank=0, name="legacy.restore")
    module, optimizer, slices = parallel.module, parallel.optimizer, parallel.slices
    if getattr(module, "plan", None) is not None:
        return _restore_stage(hvd, payload, parallel, ctx)
    problem = PIPELINE_FILE if "stages" in payload else (
        misfit(module.variables, payload["model"], "model", slices.saved_model_shapes())
        or misfit(optimizer.variables, payload["optimizer"], "optimizer", slices.saved_optimizer_shapes(optimizer)))
    if problem:
        raise ConfigError(problem)
    _assign(module.variables, slices.local_model_arrays(payload["model"]))
    _assign(optimizer.variables, slices.local_optimizer_arrays(optimizer, payload["optimizer"]))
    rngs = payload["rng"]
    if rngs and len(rngs) == ctx.size:
        set_host_rng_state(rngs[ctx.rank])
    return TrainState(**payload["state"])


def _restore_stage(hvd, payload: dict, parallel, ctx) -> TrainState:
    stage, optimizer, slices = parallel.module, parallel.optimizer, parallel.slices

    def misfit_of(part: dict) -> str | None:
        shapes = None if slices is None else slices.saved_model_shapes()
        problem = misfit(stage.variables, part["model"], "stage", shapes)
        if problem is None and part["optimizer"] is not None:
            shapes = None if slices is None else slices.saved_optimizer_shapes(optimizer)
            problem = misfit(optimizer.variables, part["optimizer"], "optimizer", shapes)
        return problem

    def load(mine: dict) -> None:
        _assign(stage.variables, mine["model"] if slices is None else slices.local_model_arrays(mine["model"]))
        if mine["optimizer"] is not None:
            moments = mine["optimizer"]
            _assign(optimizer.variables, moments if slices is None else slices.local_optimizer_arrays(optimizer, moments))

    return restore_own_stage(hvd, payload, ctx.pipeline, "the newest checkpoint", misfit_of, load, set_host_rng_state,
                             stage.plan)
