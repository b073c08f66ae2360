"""Checkpoints written before shards still resume: one `ckpt-<step>.pt` file, from rank 0.

Such a file holds the whole model's state (data parallelism, model-split; under tensor
parallelism the whole model's, gathered) or, for a pipeline, each stage's state as that stage
held it. It resumes at the layout it was written at: any tp for the unsplit state, the same
stages cut at the same blocks for a pipeline. Rank 0 reads it and broadcasts it; each rank keeps
its part. The first checkpoint the resumed job writes is a folder of shards
(hvd_runtime.torch.checkpoint), which resumes at any layout.
"""

from __future__ import annotations

from torch import nn

from hvd_runtime.checkpoint import TrainState, misfit_message
from hvd_runtime.config import ConfigError
from hvd_runtime.pipeline.checkpoint import restore_own_stage
from hvd_runtime.torch.rng import set_rng_state, tensor_text


def model_misfit(saved: dict, current: dict) -> str | None:
    """Why a checkpoint's weights cannot load into this model (another dataset's classes, other
    layer sizes), as the config error the user sees; None when they fit. `current`: the model's
    state_dict, or the shapes it has in a checkpoint (its unsplit ones)."""
    shapes = {k: tuple(v.shape) for k, v in saved.items()}
    wanted = {k: tuple(getattr(v, "shape", v)) for k, v in current.items()}
    if shapes == wanted:
        return None
    differ = sorted(k for k in set(shapes) | set(wanted) if shapes.get(k) != wanted.get(k))
    return misfit_message(f"{differ[0]}: {shapes.get(differ[0])} saved, {wanted.get(differ[0])} now")


def _json_rngs(rngs: list | None) -> list | None:
    """The per-rank RNG states of an old file (Python, NumPy and torch objects) in the form
    hvd_runtime.torch.rng.set_rng_state takes."""
    if not rngs:
        return None
    return [{"python": [s["python"][0], list(s["python"][1]), s["python"][2]],
             "numpy": [s["numpy"][0], s["numpy"][1].tolist(), *(x.item() if hasattr(x, "item") else x
                                                                for x in s["numpy"][2:])],
             "torch": tensor_text(s["torch"]), "cuda": [tensor_text(c) for c in s["cuda"]]} for s in rngs]


def _whole_shapes(module: nn.Module, slices=None) -> dict[str, tuple[int, ...]]:
    return slices.saved_shapes() if slices is not None else {k: tuple(v.shape) for k, v in module.state_dict().items()}


def legacy_payload(payload: dict, module: nn.Module) -> dict:
    """Rank 0: a whole-model file's payload as the module loads it, or {"misfit": the line}."""
    if "stages" in payload:
        return {"misfit": "the newest checkpoint was written by a pipeline before checkpoints were sharded: resume "
                          "it with --strategy pipeline as it was written, point --checkpoint.dir elsewhere, or pass "
                          "--checkpoint.resume false"}
    misfit = model_misfit(payload["model"], _whole_shapes(module))
    return {"misfit": misfit} if misfit else {**payload, "rng": _json_rngs(payload.get("rng"))}


def restore_legacy(payload: dict | None, parallel, ctx) -> TrainState:
    """Every rank calls, `payload` read on rank 0: a tensor-parallel model takes its slices of the
    unsplit state, a pipeline stage its own stage's part (the cut checked first)."""
    import horovod.torch as hvd

    module, optimizer, slices = parallel.module, parallel.optimizer, parallel.slices
    if payload is not None:
        payload = {**payload, "rng": _json_rngs(payload.get("rng"))}
    payload = hvd.broadcast_object(payload, root_rank=0, name="checkpoint.legacy")
    if ctx.pipeline is not None:
        def load(mine: dict) -> None:
            module.load_state_dict(mine["model"] if slices is None else slices.local_model_state(mine["model"]))
            if optimizer is not None and mine["optimizer"] is not None:
                moments = mine["optimizer"]
                optimizer.load_state_dict(moments if slices is None else slices.local_optimizer_state(optimizer, moments))

        return restore_own_stage(hvd, payload, ctx.pipeline, "the newest checkpoint",
                                 lambda part: model_misfit(part["model"], _whole_shapes(module, slices)), load,
                                 set_rng_state, getattr(module, "plan", None))
    if "stages" in payload:
        raise ConfigError(legacy_payload(payload, module)["misfit"])
    misfit = model_misfit(payload["model"], _whole_shapes(module, slices))
    if misfit:
        raise ConfigError(misfit)
    module.load_state_dict(slices.local_model_state(payload["model"]))
    optimizer.load_state_dict(slices.local_optimizer_state(optimizer, payload["optimizer"]))
    rngs = payload.get("rng")
    if rngs and len(rngs) == ctx.size:
        set_rng_state(rngs[ctx.rank])
    return TrainState(**payload["state"])
