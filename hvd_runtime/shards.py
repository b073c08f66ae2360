"""Sharded checkpoints, whatever the framework: each rank writes what it holds, one index makes it valid.

A checkpoint is a folder `ckpt-<step>/` of one safetensors file per writing rank and `index.json`:

    ckpt-000000120/
        rank-00000.safetensors     the tensors and slices rank 0 holds, under their whole-model names
        rank-00001.safetensors     ... one file per rank of the first replica (one for data parallelism)
        index.json                 written last: which file holds which part of which tensor

Every tensor keeps its name in the whole model (`model/<name>`, `optimizer/<parameter>/<slot>`), and
each piece its Placement: the whole tensor's shape and, for a slice, the dimension it was cut
along and the whole positions it holds, as runs. A rank resuming in another layout (another tp,
another pipeline cut, unsplit) reads from each file only the rows it will hold (plan_reads), or
the part of each piece its slice crosses where the pieces were cut along another dimension (ZeRO's
rows read as tensor parallelism's columns: cut_across): safetensors reads a slice without reading
the tensor.

The folder is written under a hidden name and renamed into place once the index is in it
(CheckpointStore.publish), so a job killed in the middle leaves the previous checkpoint the newest
valid one. The index records each file's size: a truncated or missing file is found before any
tensor is read (read_index), and the caller falls back to the previous checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = 1
INDEX = "index.json"
MODEL, OPTIMIZER = "model/", "optimizer/"   # the prefixes of the model's and the optimizer's names


class DamagedCheckpoint(ValueError):
    """A checkpoint folder whose index or files do not hold what the index says; the message names which."""


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def runs_of(positions) -> list[list[int]]:
    """`positions` (whole positions in a slice's own order) as runs [start, stop) of consecutive ones."""
    runs: list[list[int]] = []
    for p in (int(p) for p in positions):
        if runs and runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, p + 1])
    return runs


@dataclass(frozen=True)
class Placement:
    """Where a tensor a rank holds sits in the whole one: the whole `shape` and, for a slice, the
    `dim` it was cut along and the whole positions it holds there (`runs`, in its own order)."""

    shape: tuple[int, ...]
    dim: int | None = None
    runs: tuple[tuple[int, int], ...] = ()

    @classmethod
    def whole(cls, shape) -> "Placement":
        return cls(tuple(int(s) for s in shape))

    @classmethod
    def slice(cls, shape, dim: int, positions) -> "Placement":
        return cls(tuple(int(s) for s in shape), dim, tuple(tuple(r) for r in runs_of(positions)))

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] = sum(b - a for a, b in self.runs)
        return tuple(shape)

    def part(self, dim: int, start: int, stop: int) -> "Placement":
        """The placement of positions [start, stop) along `dim` of a tensor placed as this one (ZeRO's
        rows of a tensor-parallel slice): one dimension cut, so `dim` must be the one cut already."""
        if self.dim is None:
            return Placement.slice(self.shape, dim, range(start, stop))
        if dim != self.dim:
            raise ValueError(f"a part along dimension {dim} of a slice along {self.dim} is cut along two")
        return Placement.slice(self.shape, dim, [p for a, b in self.runs for p in range(a, b)][start:stop])

    def along(self, dim: int) -> tuple[tuple[int, int], ...]:
        """Its runs along `dim`: all of it, for a whole tensor."""
        if self.dim is None:
            return ((0, self.shape[dim]),)
        return self.runs

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dim": self.dim, "runs": [list(r) for r in self.runs]}

    @classmethod
    def from_json(cls, entry: dict) -> "Placement":
        return cls(tuple(entry["shape"]), entry["dim"], tuple(tuple(r) for r in entry["runs"]))


@dataclass(frozen=True)
class Copy:
    """One read: rows `src` of a saved piece (`file`, `key`) into rows `dst` of the tensor being
    loaded, both along `dim`; dim None copies the whole tensor."""

    file: str
    key: str
    dim: int | None
    src: tuple[int, int] = (0, 0)
    dst: tuple[int, int] = (0, 0)


def plan_reads(name: str, want: Placement, entry: dict) -> list[Copy]:
    """The reads that fill a tensor placed as `want` from the index's `entry` for it.

    Raises DamagedCheckpoint when the pieces do not cover it (a file of the index lacks a slice),
    ValueError when the whole shapes differ (the caller names that as a misfit beforehand).
    """
    if tuple(entry["shape"]) != want.shape:
        raise ValueError(f"{name}: {tuple(entry['shape'])} saved, {want.shape} now")
    pieces = [(piece, Placement.from_json({"shape": entry["shape"], **piece})) for piece in entry["pieces"]]
    if want.dim is None:
        whole = next(((p, at) for p, at in pieces if at.dim is None), None)
        if whole is not None:
            return [Copy(whole[0]["file"], whole[0]["key"], None)]
    dims = {at.dim for _, at in pieces if at.dim is not None}
    dim = want.dim if want.dim is not None else (dims.pop() if len(dims) == 1 else None)
    if dim is None or dims - {dim}:
        raise DamagedCheckpoint(f"{name} is saved in pieces that do not fit together")
    copies, covered = [], 0
    wanted, start = [], 0
    for a, b in want.along(dim):
        wanted.append((a, b, start))
        start += b - a
    for piece, at in pieces:
        offset = 0
        for a, b in at.along(dim):
            for wa, wb, wstart in wanted:
                lo, hi = max(a, wa), min(b, wb)
                if lo < hi:
                    copies.append(Copy(piece["file"], piece["key"], dim, (offset + lo - a, offset + hi - a),
                                       (wstart + lo - wa, wstart + hi - wa)))
                    covered += hi - lo
            offset += b - a
        if covered >= start:
            break   # a whole piece and the slices of it (pieces never overlap otherwise)
    if covered != start:
        raise DamagedCheckpoint(f"the checkpoint holds {covered} of the {start} rows {name} needs along "
                                f"dimension {dim}")
    return copies


def cut_across(want: Placement, saved: dict) -> int | None:
    """The dimension a tensor was saved cut along, where `want` is a slice along another one (and
    no piece holds it whole); None where plan_reads' copies along one dimension serve."""
    pieces = saved["pieces"]
    if want.dim is None or any(piece["dim"] is None for piece in pieces):
        return None
    dims = {piece["dim"] for piece in pieces}
    return dims.pop() if len(dims) == 1 and want.dim not in dims else None


class ShardReader:
    """The files of one checkpoint folder, each opened once (memory-mapped); fills tensors placed as
    this rank holds them. `framework`: safetensors' "pt" (torch tensors) or "np" (NumPy arrays)."""

    def __init__(self, folder: Path, index: dict, framework: str = "pt"):
        self.folder, self.index, self.framework, self._open = folder, index, framework, {}

    def close(self) -> None:
        """Let go of every opened file: its memory map, and with it the pages read so far."""
        self._open.clear()

    def file(self, name: str):
        """The safetensors file `name` of the folder, opened on first use."""
        from safetensors import safe_open

        if name not in self._open:
            self._open[name] = safe_open(self.folder / name, framework=self.framework, device="cpu")
        return self._open[name]

    def read(self, entry: str, want: Placement):
        """The tensor `entry` as `want` places it, assembled from the rows of the pieces holding them."""
        saved = self.index["tensors"][entry]
        across = cut_across(want, saved)
        if across is not None:
            return self._read_across(entry, want, saved, across)
        copies = plan_reads(entry, want, saved)
        if len(copies) == 1 and copies[0].dim is None:
            return self.file(copies[0].file).get_tensor(copies[0].key)
        out = None
        for copy in copies:
            piece = self._piece(copy)
            if out is None:
                out = piece.new_empty(want.local_shape) if self.framework == "pt" else \
                    np.empty(want.local_shape, dtype=piece.dtype)
            out[(slice(None),) * copy.dim + (slice(*copy.dst),)] = piece
        return out

    def _read_across(self, entry: str, want: Placement, saved: dict, dim: int):
        """`want`'s slice along want.dim of a tensor saved in pieces cut along `dim` (ZeRO's rows
        read as a tensor-parallel slice of columns, and back): each piece's part of the slice."""
        if tuple(saved["shape"]) != want.shape:
            raise ValueError(f"{entry}: {tuple(saved['shape'])} saved, {want.shape} now")
        out, covered, ndim = None, 0, len(want.shape)
        for piece in saved["pieces"]:
            sliced = self.file(piece["file"]).get_slice(piece["key"])
            offset = 0
            for a, b in (tuple(r) for r in piece["runs"]):
                start = 0
                for wa, wb in want.runs:
                    index = [slice(None)] * ndim
                    index[dim], index[want.dim] = slice(offset, offset + b - a), slice(wa, wb)
                    part = sliced[tuple(index)]
                    if out is None:
                        out = part.new_empty(want.local_shape) if self.framework == "pt" else \
                            np.empty(want.local_shape, dtype=part.dtype)
                    index[dim], index[want.dim] = slice(a, b), slice(start, start + wb - wa)
                    out[tuple(index)] = part
                    start += wb - wa
                covered += b - a
                offset += b - a
        if covered != want.shape[dim]:
            raise DamagedCheckpoint(f"the checkpoint holds {covered} of the {want.shape[dim]} rows {entry} needs "
                                    f"along dimension {dim}")
        return out

    def _piece(self, copy: Copy):
        sliced = self.file(copy.file).get_slice(copy.key)
        return sliced[(slice(None),) * copy.dim + (slice(*copy.src),)]


def merge_index(shards: list[dict], **fields) -> dict:
    """The index rank 0 writes, from every writer's description of its file (what write_shard
    returned) and the checkpoint's other fields (train state, RNG states, pipeline cut). A part
    several writers hold alike is listed once, from the first: pieces never overlap."""
    tensors: dict[str, dict] = {}
    values: dict[str, object] = {}
    files = {}
    for shard in shards:
        files[shard["file"]] = {"bytes": shard["bytes"]}
        for name, entry in shard["tensors"].items():
            pieces = tensors.setdefault(name, {"shape": entry["shape"], "pieces": []})["pieces"]
            if not any(p["dim"] == entry["dim"] and p["runs"] == entry["runs"] for p in pieces):
                # the same part held by several ranks (ZeRO's rows of a tensor tp keeps whole) listed once
                pieces.append({"file": shard["file"], "key": entry["key"], "dim": entry["dim"],
                               "runs": entry["runs"]})
        values.update(shard["values"])
    return {"format": FORMAT, **fields, "files": files, "tensors": tensors, "values": values}


def write_json(path: Path, obj: dict) -> None:
    """Write `obj` as JSON and make it durable before returning (the index is what makes a checkpoint)."""
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def read_index(folder: Path) -> dict:
    """The index of a checkpoint folder, once every file it names is there at its full size."""
    try:
        index = json.loads((folder / INDEX).read_text())
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(f"its {INDEX} cannot be read ({exc})") from exc
    if index.get("format") != FORMAT:
        raise DamagedCheckpoint(f"its {INDEX} is of format {index.get('format')!r}, this runtime reads {FORMAT}")
    for name, described in index["files"].items():
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpoint(f"{name} is missing")
        if path.stat().st_size != described["bytes"]:
            raise DamagedCheckpoint(f"{name} is {path.stat().st_size} bytes, the index says {described['bytes']} "
                                    "(truncated?)")
    return index


def index_misfit(index: dict, wanted: dict[str, tuple[int, ...]]) -> str | None:
    """Why the model's tensors (`wanted`: every `model/...` name the job holds, with its whole
    shape) do not match the checkpoint's: a name missing on either side or a shape changed."""
    saved = {k: tuple(v["shape"]) for k, v in index["tensors"].items() if k.startswith("model/")}
    if saved == wanted:
        return None
    differ = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    name = differ[0].removeprefix("model/")
    return f"{name}: {saved.get(differ[0])} saved, {wanted.get(differ[0])} now"
