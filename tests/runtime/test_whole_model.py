"""The whole model written from a checkpoint's shards, one tensor at a time (hvd_runtime.torch.whole_model).

A checkpoint of two "ranks" is written the way save_checkpoint writes one (each rank's
safetensors file of the slices it holds, an index merged from their descriptions): a
column-parallel weight cut in fused-q/k/v runs, a row-parallel one, a vocabulary-split embedding
tied to the head, whole tensors written once, a bf16 buffer. The file write_whole_model makes
from it is an ordinary safetensors file: safetensors reads it back as the unsplit state_dict,
bit for bit, and the whole model loads it. While it is written, no tensor larger than the
largest single tensor of the model is ever allocated: the whole model never is.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hvd_runtime.checkpoint import CheckpointStore
from hvd_runtime.shards import INDEX, Placement, merge_index, write_json
from hvd_runtime.torch.checkpoint import _write_shard
from hvd_runtime.torch.whole_model import load_whole_model, model_file, write_whole_model
from hvd_runtime.tracking.models import ModelFile


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(10, 4)
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(12, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.tokens.weight
        self.register_buffer("scale", torch.arange(3, dtype=torch.bfloat16))

    def forward(self, idx):
        return self.out(self.proj(self.qkv(self.tokens(idx))))


def build() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


# rank r's rows (or columns) of each split tensor: q/k/v runs of 2 of each 4, input columns, vocab rows
SPLITS = {"qkv.weight": (0, [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]),
          "qkv.bias": (0, [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]),
          "proj.weight": (1, [list(range(0, 6)), list(range(6, 12))]),
          "tokens.weight": (0, [list(range(0, 5)), list(range(5, 10))]),
          "out.weight": (0, [list(range(0, 5)), list(range(5, 10))])}


def write_checkpoint(folder, whole: dict[str, torch.Tensor]) -> None:
    """Two ranks' shards and the index, as save_checkpoint writes them (rank 0 also writes the whole tensors)."""
    folder.mkdir(parents=True)
    shards = []
    for rank in (0, 1):
        held = {}
        for name, t in whole.items():
            if name in SPLITS:
                dim, parts = SPLITS[name]
                held[f"model/{name}"] = (t.index_select(dim, torch.tensor(parts[rank])),
                                         Placement.slice(t.shape, dim, parts[rank]))
            else:
                held[f"model/{name}"] = (t, Placement.whole(t.shape))
        held["optimizer/qkv.weight/step"] = (3, None)
        shards.append(_write_shard(folder, rank, held, write_whole=rank == 0))
    write_json(folder / INDEX, merge_index(shards, step=7, state={}, rng=None, cut=None))


class LargestAllocation(TorchDispatchMode):
    """The most bytes the storage of any tensor made while it is on holds (outputs of every op)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_the_whole_model_is_written_from_slices_a_tensor_at_a_time(tmp_path):
    whole = {name: t.detach().clone() for name, t in build().state_dict().items()}
    write_checkpoint(tmp_path / "ckpt-000000007", whole)

    with LargestAllocation() as counted:
        written = write_whole_model(tmp_path / "ckpt-000000007", tmp_path / "out" / "model.safetensors")
    assert written == tmp_path / "out" / "model.safetensors"
    assert [p.name for p in written.parent.iterdir()] == ["model.safetensors"], "a partial file left behind"
    largest = max(t.numel() * t.element_size() for t in whole.values())
    assert 0 < counted.largest <= largest < sum(t.numel() * t.element_size() for t in whole.values())

    loaded = load_file(str(written))
    assert set(loaded) == set(whole), "every state_dict name, a tied weight under each of its names"
    for name, t in whole.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name

    model = load_whole_model(Tiny(), written)
    assert model.out.weight is model.tokens.weight and torch.equal(model.qkv.weight, whole["qkv.weight"])


def test_the_newest_checkpoint_becomes_a_model_file_the_tracker_builds(tmp_path):
    whole = {name: t.detach().clone() for name, t in build().state_dict().items()}
    store = CheckpointStore(tmp_path / "checkpoints", keep=3)
    write_checkpoint(tmp_path / "checkpoints" / "ckpt-000000003", {k: torch.zeros_like(v) for k, v in whole.items()})
    write_checkpoint(tmp_path / "checkpoints" / "ckpt-000000007", whole)

    record = model_file(store, Tiny, tmp_path / "run" / "checkpoint-2.safetensors", discard=True)
    assert isinstance(record, ModelFile)
    built = record.load()
    assert isinstance(built, Tiny)
    assert all(torch.equal(built.state_dict()[k], v) for k, v in whole.items()), "not the newest checkpoint's"
    record.finished()
    assert not (tmp_path / "run" / "checkpoint-2.safetensors").exists(), "a discardable copy was kept"
    kept = model_file(store, Tiny, tmp_path / "run" / "model.safetensors")
    kept.finished()
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_a_checkpoint_file_from_before_shards_is_written_whole_too(tmp_path):
    """A run resumed from a `ckpt-<step>.pt` after its last epoch trains nothing: its newest
    checkpoint is that file, and the model file comes from it (tied weights under both names)."""
    whole = {name: t.detach().clone() for name, t in build().state_dict().items()}
    store = CheckpointStore(tmp_path / "checkpoints", keep=3)
    (tmp_path / "checkpoints").mkdir()
    torch.save({"model": build().state_dict(), "optimizer": {}, "state": {}},
               tmp_path / "checkpoints" / "ckpt-000000009.pt")
    record = model_file(store, Tiny, tmp_path / "run" / "model.safetensors")
    loaded = load_file(record.weights)
    assert set(loaded) == set(whole) and all(torch.equal(loaded[k], v) for k, v in whole.items())
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["model.safetensors"]
