"""The whole Keras model as one safetensors file, written a tensor at a time from a checkpoint's shards.

    weights = write_whole_model(checkpoint, run_dir / "model.safetensors")    # rank 0, no collective
    model = load_whole_model(build_model(...), weights)                      # wherever it is served
    tracker.log_model(model_file(checkpoints, build_whole, out), ...)            # rank 0: the newest, logged

The TensorFlow side of hvd_runtime.torch.whole_model: every TF run ends with its model written
from the newest checkpoint's shards (hvd_runtime.whole_file), so a model split over ranks is
never gathered whole to write it. The file maps each variable's name in the whole model
(hvd_runtime.tf.names.whole_names: `2.qkv.kernel`, `0.tokens.embeddings`) to its value;
`load_whole_model` assigns them to a freshly built model by the same names, whatever Keras named
its layers in that process.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import numpy as np

from hvd_runtime.checkpoint import CheckpointStore
from hvd_runtime.tf.names import whole_names
from hvd_runtime.tf.legacy_checkpoint import read_legacy
from hvd_runtime.tracking.models import ModelFile
from hvd_runtime.whole_file import write_whole_file

__all__ = ["load_whole_model", "model_file", "write_whole_model"]


def write_whole_model(checkpoint: Path, out: Path, build=None) -> Path:
    """Write the model of the checkpoint folder `checkpoint` to `out` as one safetensors file of
    whole variables, one in memory at a time; returns `out`, never a partial file. A
    `ckpt-<step>.pkl` from before shards holds the variables in order, without names: `build()`
    (the whole model) names them."""
    if checkpoint.is_dir():
        return write_whole_file(checkpoint, out, "np")
    from safetensors.numpy import save_file

    payload = read_legacy(checkpoint)
    arrays = payload["model"] if "stages" not in payload else [
        a for _, part in sorted(payload["stages"].items()) for a in part["model"]]
    model = build()
    names = whole_names(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial_out = out.with_name(f".{out.name}.partial")
    try:
        save_file({names[id(v)]: np.asarray(a) for v, a in zip(model.variables, arrays) if id(v) in names},
                  str(partial_out))
        os.replace(partial_out, out)
    finally:
        partial_out.unlink(missing_ok=True)
    return out


def load_whole_model(model, weights: Path):
    """`model` (the unsplit Keras model, built) with the file's weights, by name; returns it."""
    from safetensors.numpy import load_file

    saved = load_file(str(weights))
    names = whole_names(model)
    missing = sorted(set(names.values()) - set(saved))
    if missing:
        raise ValueError(f"{weights} holds no {missing[0]}: it was written for another model")
    for v in model.variables:
        if id(v) in names:
            v.assign(saved[names[id(v)]])
    return model


def _built_with(build, weights: str):
    return load_whole_model(build(), weights)


def model_file(store: CheckpointStore, build, out: Path, discard: bool = False) -> ModelFile:
    """Rank 0: the model of the store's newest checkpoint written to `out` (write_whole_model), as
    the record a tracker logs: the whole model `build()` makes, loaded with these weights where
    it is logged (`discard`: `out` is removed once logged)."""
    weights = str(write_whole_model(store.newest(), Path(out), build))
    return ModelFile(weights, partial(_built_with, build, weights), discard, flavor="tensorflow")
