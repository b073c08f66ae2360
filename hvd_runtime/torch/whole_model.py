"""The whole model as one safetensors file, written a tensor at a time from a checkpoint's shards.

    weights = write_whole_model(checkpoint, run_dir / "model.safetensors")    # rank 0, no collective
    model = load_whole_model(build_model(...), weights)                      # wherever it is served
    tracker.log_model(model_file(checkpoints, unsplit, out), ...)            # rank 0: the newest, logged

Every torch run ends with its model written this way, and its MLflow models are logged from such
files (hvd_runtime.tracking.models.ModelFile). A model split over ranks (pipeline stages,
tensor-parallel slices) is thus never gathered whole into a training process: rank 0 reads the
checkpoint every rank just wrote (hvd_runtime.torch.checkpoint) and writes each of the model's
tensors into one file, assembled from its pieces, then drops it and the shards' memory maps
before the next one. The writer's memory stays at its own share plus the largest single tensor.
The file is an ordinary safetensors file of the unsplit model's state_dict (a tied weight under
each of its names), which `safetensors.torch.load_file` and `load_whole_model` read.

safetensors writes a file from a dict of tensors all in memory at once, so the header (every
tensor's name, dtype, shape and byte range, known from the index before any tensor is read) is
written first and the tensors after it, in the format safetensors reads: 8 bytes of header
length, the JSON header padded with spaces to 8 bytes, then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import os
import struct
from functools import partial
from pathlib import Path

import torch
from torch import nn

from hvd_runtime.checkpoint import CheckpointStore
from hvd_runtime.shards import Placement, read_index
from hvd_runtime.torch.checkpoint import MODEL, ShardReader
from hvd_runtime.tracking.models import ModelFile

__all__ = ["load_whole_model", "model_file", "write_whole_model"]

# safetensors' dtype names, and bytes per element
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _header(reader: ShardReader, names: list[str]) -> tuple[bytes, list[tuple[str, tuple[int, ...]]]]:
    """The file's header (padded) and, in its order, each tensor's name and whole shape."""
    header, order, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for entry in names:
        saved = reader.index["tensors"][entry]
        piece = saved["pieces"][0]
        dtype = reader.file(piece["file"]).get_slice(piece["key"]).get_dtype()
        shape = tuple(saved["shape"])
        size = DTYPES[dtype] * int(torch.Size(shape).numel())
        header[entry.removeprefix(MODEL)] = {"dtype": dtype, "shape": list(shape),
                                             "data_offsets": [offset, offset + size]}
        order.append((entry, shape))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8), order


def write_whole_model(checkpoint: Path, out: Path) -> Path:
    """Write the model of the checkpoint folder `checkpoint` to `out` as one safetensors file of
    whole tensors, one tensor in memory at a time; returns `out`. Written under a temporary name
    and renamed, so `out` is never a partial file. A `ckpt-<step>.pt` from before shards (rank 0
    read it whole to resume it anyway) is written from its whole state."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    if not checkpoint.is_dir():
        return _write_legacy(checkpoint, out, partial)
    index = read_index(checkpoint)
    reader = ShardReader(checkpoint, index)
    header, order = _header(reader, sorted(k for k in index["tensors"] if k.startswith(MODEL)))
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for entry, shape in order:
                tensor = reader.read(entry, Placement.whole(shape)).contiguous()
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
                del tensor
                reader.close()  # the pages of the shards read so far would stay resident while mapped
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


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
    """`model` (the unsplit model, built for real) with the file's weights; returns it."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(weights)))
    return model


def _built_with(build, weights: str) -> nn.Module:
    return load_whole_model(build(), weights)


def model_file(store: CheckpointStore, build, out: Path, discard: bool = False) -> ModelFile:
    """Rank 0: the model of the store's newest checkpoint written to `out` (write_whole_model), as
    the record a tracker logs: the unsplit model `build()` makes, loaded with these weights where
    it is logged (`discard`: `out` is removed once logged)."""
    weights = str(write_whole_model(store.paths()[0], Path(out)))
    return ModelFile(weights, partial(_built_with, build, weights), discard)
