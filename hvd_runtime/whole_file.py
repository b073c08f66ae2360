"""The whole model as one safetensors file, written a tensor at a time from a checkpoint's shards.

    write_whole_file(checkpoint_folder, run_dir / "model.safetensors", "pt")   # rank 0, no collective

Whatever the framework (`"pt"` for torch, `"np"` for TensorFlow's NumPy arrays): rank 0 reads the
checkpoint every rank just wrote (hvd_runtime.shards) and writes each of the model's tensors into
one file, assembled from its pieces, then drops it and the shards' memory maps before the next
one. The writer's memory stays at its own share plus the largest single tensor, so a model split
over ranks is never gathered whole into a training process.

safetensors writes a file from a dict of tensors all in memory at once, so the header (every
tensor's name, dtype, shape and byte range, known from the index before any tensor is read) is
written first and the tensors after it, in the format safetensors reads: 8 bytes of header
length, the JSON header padded with spaces to 8 bytes, then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from hvd_runtime.shards import MODEL, Placement, ShardReader, read_index

__all__ = ["write_whole_file"]

# safetensors' dtype names, and bytes per element
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _header(reader: ShardReader, names: list[str]) -> tuple[bytes, list[tuple[str, tuple[int, ...]]]]:
    """The file's header (padded) and, in its order, each tensor's name and whole shape."""
    header, order, offset = {"__metadata__": {"format": reader.framework}}, [], 0
    for entry in names:
        saved = reader.index["tensors"][entry]
        piece = saved["pieces"][0]
        dtype = reader.file(piece["file"]).get_slice(piece["key"]).get_dtype()
        shape = tuple(saved["shape"])
        size = DTYPES[dtype] * math.prod(shape)
        header[entry.removeprefix(MODEL)] = {"dtype": dtype, "shape": list(shape),
                                             "data_offsets": [offset, offset + size]}
        order.append((entry, shape))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8), order


def _raw(tensor, framework: str) -> memoryview:
    """A tensor's bytes, in the order safetensors stores them (C order, little-endian)."""
    if framework == "pt":
        import torch

        return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
    return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data


def write_whole_file(checkpoint: Path, out: Path, framework: str) -> Path:
    """Write the model of the checkpoint folder `checkpoint` to `out` as one safetensors file of
    whole tensors, one tensor in memory at a time; returns `out`. Written under a temporary name
    and renamed, so `out` is never a partial file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    index = read_index(checkpoint)
    reader = ShardReader(checkpoint, index, framework)
    header, order = _header(reader, sorted(k for k in index["tensors"] if k.startswith(MODEL)))
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for entry, shape in order:
                tensor = reader.read(entry, Placement.whole(shape))
                f.write(_raw(tensor, framework))
                del tensor
                reader.close()  # the pages of the shards read so far would stay resident while mapped
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out
