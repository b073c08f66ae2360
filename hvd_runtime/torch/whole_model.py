"""The whole model as one safetensors file, written a tensor at a time from a checkpoint's shards.

    weights = write_whole_model(checkpoint, run_dir / "model.safetensors")    # rank 0, no collective
    model = load_whole_model(build_model(...), weights)                      # wherever it is served
    tracker.log_model(model_file(checkpoints, build_whole, out), ...)            # rank 0: the newest, logged

Every torch run ends with its model written this way (hvd_runtime.whole_file: from the shards,
a tensor at a time, so a model split over ranks is never gathered whole into a training
process), and its MLflow models are logged from such files (hvd_runtime.tracking.models.ModelFile).
The file is an ordinary safetensors file of the whole model's state_dict (a tied weight under
each of its names), which `safetensors.torch.load_file` and `load_whole_model` read.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch
from torch import nn

from hvd_runtime.checkpoint import CheckpointStore
from hvd_runtime.tracking.models import ModelFile
from hvd_runtime.whole_file import write_whole_file

__all__ = ["load_whole_model", "model_file", "write_whole_model"]


def write_whole_model(checkpoint: Path, out: Path) -> Path:
    """Write the model of the checkpoint folder `checkpoint` to `out` as one safetensors file of
    whole tensors, one tensor in memory at a time; returns `out`. Written under a temporary name
    and renamed, so `out` is never a partial file. A `ckpt-<step>.pt` from before shards (rank 0
    read it whole to resume it anyway) is written from its whole state."""
    if checkpoint.is_dir():
        return write_whole_file(checkpoint, out, "pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    return _write_legacy(checkpoint, out, out.with_name(f".{out.name}.partial"))


def _write_legacy(checkpoint: Path, out: Path, partial: Path) -> Path:
    from safetensors.torch import save_file

    payload = torch.load(checkpoint, map_location="cpu", weights_only=False)
    state = payload["model"] if "model" in payload else {
        name: t for stage in payload["stages"].values() for name, t in stage["model"].items()}
    try:   # a tensor of its own under each name: safetensors refuses tied (shared) ones
        save_file({name: t.detach().clone().contiguous() for name, t in state.items()}, str(partial))
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def load_whole_model(model: nn.Module, weights: Path) -> nn.Module:
    """`model` (the whole model, built for real) with the file's weights; returns it."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(weights)))
    return model


def _built_with(build, weights: str) -> nn.Module:
    return load_whole_model(build(), weights)


def model_file(store: CheckpointStore, build, out: Path, discard: bool = False) -> ModelFile:
    """Rank 0: the model of the store's newest checkpoint written to `out` (write_whole_model), as
    the record a tracker logs: the whole model `build()` makes, loaded with these weights where
    it is logged (`discard`: `out` is removed once logged)."""
    weights = str(write_whole_model(store.newest(), Path(out)))
    return ModelFile(weights, partial(_built_with, build, weights), discard)
