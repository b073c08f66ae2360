"""The framework-free half of sharded checkpoints: where slices sit, which rows a rank reads, the folder's life.

A rank's slice of a tensor-parallel layer holds arbitrary whole positions (a fused q/k/v projection
holds a run of each); plan_reads must fill every row a rank will hold from whatever pieces were
saved, in any layout, and say so when the pieces fall short. The store takes a folder for a
checkpoint only once its index is in it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvd_runtime.checkpoint import CheckpointStore
from hvd_runtime.shards import (DamagedCheckpoint, Placement, ShardReader, index_misfit, merge_index, plan_reads,
                                read_index, runs_of, write_json)


def test_positions_become_runs_in_their_own_order():
    assert runs_of([0, 1, 2, 8, 9, 4]) == [[0, 3], [8, 10], [4, 5]]
    assert Placement.slice((12, 3), 0, [0, 1, 2, 8, 9, 4]).local_shape == (6, 3)
    assert Placement.whole((12, 3)).local_shape == (12, 3)


def test_a_part_of_a_slice_is_its_positions_along_the_same_dimension():
    """ZeRO's rows of a tensor-parallel slice: positions [start, stop) of the slice's own order."""
    cols = Placement.slice((4, 12), 1, [0, 1, 2, 8, 9, 4])
    assert cols.part(1, 2, 5) == Placement.slice((4, 12), 1, [2, 8, 9])
    assert Placement.whole((10, 3)).part(0, 5, 10) == Placement.slice((10, 3), 0, range(5, 10))
    with pytest.raises(ValueError, match="cut along two"):
        cols.part(0, 0, 2)


def test_a_part_several_ranks_hold_alike_is_listed_once():
    """Two ranks of a tensor-parallel group hold the same ZeRO rows of a tensor it keeps whole."""
    rows = [Placement.slice((8,), 0, range(0, 4)), Placement.slice((8,), 0, range(0, 4)),
            Placement.slice((8,), 0, range(4, 8))]
    index = merge_index([{"file": f"r{i}", "bytes": 0, "values": {}, "tensors": {"t": {"key": "t", **at.to_json()}}}
                         for i, at in enumerate(rows)])
    assert [(p["file"], p["runs"]) for p in index["tensors"]["t"]["pieces"]] == [("r0", [[0, 4]]), ("r2", [[4, 8]])]
    assert index["files"].keys() == {"r0", "r1", "r2"}
    copies = plan_reads("t", Placement.whole((8,)), index["tensors"]["t"])
    assert [(c.file, c.dst) for c in copies] == [("r0", (0, 4)), ("r2", (4, 8))]


def entry_of(pieces: dict[str, Placement], shape) -> dict:
    """The index entry of one tensor saved as `pieces` (file name -> placement)."""
    return merge_index([{"file": f, "bytes": 0, "values": {},
                         "tensors": {"t": {"key": "t", **at.to_json()}}} for f, at in pieces.items()])["tensors"]["t"]


def apply(copies, saved: dict[str, np.ndarray], want: Placement) -> np.ndarray:
    """Carry out plan_reads' copies with NumPy, as a framework's reader does."""
    out = np.full(want.local_shape, np.nan)
    for c in copies:
        if c.dim is None:
            return saved[c.file]
        src = np.take(saved[c.file], range(*c.src), axis=c.dim)
        index = [slice(None)] * out.ndim
        index[c.dim] = slice(*c.dst)
        out[tuple(index)] = src
    return out


@pytest.mark.parametrize("want_dim", [0, 1])
def test_any_slice_is_read_from_any_other_slices_or_the_whole(want_dim):
    whole = np.arange(12 * 6, dtype=float).reshape(12, 6)
    n = whole.shape[want_dim]
    halves = [list(range(0, n // 4)) + list(range(n // 2, 3 * n // 4)),
              list(range(n // 4, n // 2)) + list(range(3 * n // 4, n))]  # fused q/k style: a run of each half
    saved_as = {
        "whole": {"a": Placement.whole(whole.shape)},
        "two": {f"r{i}": Placement.slice(whole.shape, want_dim, h) for i, h in enumerate(halves)},
        "three": {f"r{i}": Placement.slice(whole.shape, want_dim, range(i * n // 3, (i + 1) * n // 3))
                  for i in range(3)},
    }
    for name, pieces in saved_as.items():
        saved = {f: whole if at.dim is None else np.take(whole, [p for a, b in at.runs for p in range(a, b)],
                                                         axis=at.dim) for f, at in pieces.items()}
        entry = entry_of(pieces, whole.shape)
        for positions in (*halves, list(range(n)), [n - 1, 0, 2]):
            want = Placement.slice(whole.shape, want_dim, positions)
            got = apply(plan_reads("t", want, entry), saved, want)
            assert np.array_equal(got, np.take(whole, positions, axis=want_dim)), (name, positions)
        want = Placement.whole(whole.shape)
        assert np.array_equal(apply(plan_reads("t", want, entry), saved, want), whole), name


@pytest.mark.parametrize("saved_dim, want_dim", [(0, 1), (1, 0)])
def test_a_slice_is_read_across_pieces_cut_along_another_dimension(tmp_path, saved_dim, want_dim):
    """ZeRO's rows (dim 0, uneven) resumed as a row-parallel layer's columns (dim 1), and back: each
    piece gives the part of the slice it crosses; a piece missing is named."""
    from safetensors.numpy import save_file

    whole = np.arange(7 * 6, dtype=np.float32).reshape(7, 6)
    n = whole.shape[saved_dim]
    cuts = [range(0, (n + 2) // 3), range((n + 2) // 3, 2 * ((n + 2) // 3)), range(2 * ((n + 2) // 3), n)]
    pieces = {f"r{i}.safetensors": Placement.slice(whole.shape, saved_dim, cut) for i, cut in enumerate(cuts)}
    for f, at in pieces.items():
        save_file({"t": np.ascontiguousarray(np.take(whole, list(range(*at.runs[0])), axis=saved_dim))}, tmp_path / f)
    reader = ShardReader(tmp_path, {"tensors": {"t": entry_of(pieces, whole.shape)}}, "np")
    m = whole.shape[want_dim]
    for positions in ([0, 1, m - 1], list(range(m // 2, m)), list(range(m))):
        got = reader.read("t", Placement.slice(whole.shape, want_dim, positions))
        assert np.array_equal(got, np.take(whole, positions, axis=want_dim)), positions
    short = ShardReader(tmp_path, {"tensors": {"t": entry_of(dict(list(pieces.items())[:2]), whole.shape)}}, "np")
    with pytest.raises(DamagedCheckpoint, match=f"rows t needs along dimension {saved_dim}"):
        short.read("t", Placement.slice(whole.shape, want_dim, [0]))


def test_pieces_that_fall_short_are_named():
    shape = (8, 2)
    entry = entry_of({"r0": Placement.slice(shape, 0, range(4))}, shape)   # r1's half is not in the index
    with pytest.raises(DamagedCheckpoint, match="holds 4 of the 8 rows t needs"):
        plan_reads("t", Placement.whole(shape), entry)
    with pytest.raises(ValueError, match=r"t: \(8, 2\) saved, \(8, 3\) now"):
        plan_reads("t", Placement.whole((8, 3)), entry)


def test_a_misfit_names_the_first_tensor_that_differs():
    index = merge_index([{"file": "f", "bytes": 0, "values": {}, "tensors": {
        "model/a": {"key": "a", **Placement.whole((2,)).to_json()},
        "optimizer/a/exp_avg": {"key": "x", **Placement.whole((2,)).to_json()}}}])
    assert index_misfit(index, {"model/a": (2,)}) is None
    assert index_misfit(index, {"model/a": (3,)}) == "a: (2,) saved, (3,) now"
    assert index_misfit(index, {"model/a": (2,), "model/b": (1,)}) == "b: None saved, (1,) now"


def publish(store: CheckpointStore, step: int, files: dict[str, bytes]):
    folder = store.staging(step)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    write_json(folder / "index.json", {"format": 1, "files": {n: {"bytes": len(d)} for n, d in files.items()},
                                       "tensors": {}, "values": {}})
    return store.publish(step, folder)


def test_a_folder_is_a_checkpoint_once_published_and_the_last_k_are_kept(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        publish(store, step, {"rank-00000.safetensors": b"x" * step})
    assert [p.name for p in store.paths()] == ["ckpt-000000030", "ckpt-000000020"]
    half = store.staging(40)          # a write that never finished: no index, a hidden name
    (half / "rank-00000.safetensors").write_bytes(b"y")
    assert [p.name for p in store.paths()][0] == "ckpt-000000030"
    publish(store, 50, {"rank-00000.safetensors": b"z"})
    assert not half.exists(), "a new write clears what an interrupted one left"
    again = publish(store, 50, {"rank-00000.safetensors": b"zz"})   # the same step again replaces it
    assert read_index(again)["files"]["rank-00000.safetensors"]["bytes"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000030", "ckpt-000000050"]


def test_a_missing_or_truncated_file_is_found_from_the_index(tmp_path):
    store = CheckpointStore(tmp_path)
    folder = publish(store, 1, {"rank-00000.safetensors": b"abcd", "rank-00001.safetensors": b"efgh"})
    (folder / "rank-00001.safetensors").write_bytes(b"ef")
    with pytest.raises(DamagedCheckpoint, match=r"rank-00001.safetensors is 2 bytes, the index says 4"):
        read_index(folder)
    (folder / "rank-00001.safetensors").unlink()
    with pytest.raises(DamagedCheckpoint, match="rank-00001.safetensors is missing"):
        read_index(folder)
    (folder / "index.json").write_text(json.dumps({"format": 0}))
    with pytest.raises(DamagedCheckpoint, match="of format 0"):
        read_index(folder)
