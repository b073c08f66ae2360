"""Keras variables under their names in the whole model, split or not, and the whole model written from shards.

hvd_runtime.tf.checkpoint names each variable by its path through the model's layers; a
tensor-parallel split layer sits under the attribute of the layer it replaces, so its slice has
the unsplit variable's name and a Placement of the unsplit shape. Checked here in one process,
with the splits of a two-rank group made the way apply_tp makes them (no collective is called
while splitting): every name is the whole model's, every slice holds exactly its placement's
rows of the unsplit variable, and two such shards make, through write_whole_model, a file that
a freshly built model (its layers auto-named differently) loads bit for bit.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from hvd_runtime.checkpoint import CheckpointStore  # noqa: E402
from hvd_runtime.parallel.tensor_groups import TensorGroup  # noqa: E402
from hvd_runtime.shards import INDEX, merge_index, write_json  # noqa: E402
from hvd_runtime.tf.checkpoint import _write_shard, held_variables  # noqa: E402
from hvd_runtime.tf.names import whole_names  # noqa: E402
from hvd_runtime.tf.stage import Stage  # noqa: E402
from hvd_runtime.tf.tensor_parallel import slice_layers  # noqa: E402
from hvd_runtime.tf.tensor_state import SlicedVariables  # noqa: E402
from hvd_runtime.tf.whole_model import load_whole_model, model_file, write_whole_model  # noqa: E402


class Block(keras.layers.Layer):
    """The attributes a transformer block has (qkv, proj, fc, out), in a block's order."""

    def __init__(self, width: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.heads = heads
        self.norm1 = keras.layers.LayerNormalization()
        self.qkv = keras.layers.Dense(3 * width)
        self.proj = keras.layers.Dense(width)
        self.fc = keras.layers.Dense(2 * width)
        self.out = keras.layers.Dense(width)

    def build(self, input_shape):
        for layer in (self.norm1, self.qkv, self.proj, self.fc):
            layer.build(input_shape)
        self.out.build((*input_shape[:-1], self.fc.units))

    def call(self, x, training=False):
        q, _, _ = keras.ops.split(self.qkv(self.norm1(x)), 3, axis=-1)
        return x + self.proj(q) + self.out(self.fc(x))


def build(seed: int = 0) -> keras.Sequential:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3, 4)), keras.Sequential([keras.layers.Dense(4), keras.layers.ReLU()]),
                             Block(4, 2), keras.layers.Dense(5)])


NAMES = {"0.0.kernel", "0.0.bias", "1.norm1.gamma", "1.norm1.beta", "1.qkv.kernel", "1.qkv.bias", "1.proj.kernel",
         "1.proj.bias", "1.fc.kernel", "1.fc.bias", "1.out.kernel", "1.out.bias", "2.kernel", "2.bias"}


def split(model, rank: int) -> Stage:
    """Rank `rank`'s layers of a group of two, as a stage holding all of them (a Sequential of them
    would be called, and so reach for the group's collectives)."""
    return Stage(slice_layers(model.layers, TensorGroup(rank, 2, None)), 0, None)


def test_every_variable_is_named_by_its_path_whatever_keras_named_the_layers():
    first, second = build(), build()
    assert {layer.name for layer in first.layers} != {layer.name for layer in second.layers}
    for model in (first, second):
        assert set(whole_names(model).values()) == NAMES
    assert [name for _, name, _ in held_variables(first, None)] == [name for _, name, _ in held_variables(second, None)]


def test_a_tensor_parallel_slice_has_the_unsplit_name_and_holds_its_rows():
    unsplit = build()
    whole = {name.removeprefix("model/"): v.numpy() for v, name, _ in held_variables(unsplit, None)}
    covered = {}
    for rank in (0, 1):
        model = split(unsplit, rank)
        held = held_variables(model, None, SlicedVariables(model))
        assert {name.removeprefix("model/") for _, name, _ in held} == NAMES
        for v, name, at in held:
            name = name.removeprefix("model/")
            assert at.shape == whole[name].shape, name
            if at.dim is None:
                np.testing.assert_array_equal(v.numpy(), whole[name], err_msg=name)
                continue
            rows = np.concatenate([np.arange(a, b) for a, b in at.runs])
            np.testing.assert_array_equal(v.numpy(), np.take(whole[name], rows, axis=at.dim), err_msg=name)
            covered.setdefault(name, []).extend(rows.tolist())
    # qkv is cut in three runs a rank (its q, k and v), and the two ranks hold every row once
    assert {n for n in covered} == {"1.qkv.kernel", "1.qkv.bias", "1.proj.kernel", "1.fc.kernel", "1.fc.bias",
                                    "1.out.kernel"}
    for name, rows in covered.items():
        dim = 1 if name in ("1.qkv.kernel", "1.fc.kernel") else 0   # column-parallel kernels: their columns
        assert sorted(rows) == list(range(whole[name].shape[dim])), name


def write_checkpoint(folder, unsplit) -> None:
    """Two tensor-parallel ranks' shards and the index, as save_checkpoint writes them."""
    folder.mkdir(parents=True)
    shards = []
    for rank in (0, 1):
        model = split(unsplit, rank)
        shards.append(_write_shard(folder, rank, held_variables(model, None, SlicedVariables(model)), rank == 0))
    write_json(folder / INDEX, merge_index(shards, step=7, state={}, rng=None, cut=None))


def test_the_whole_model_is_written_from_the_shards_and_loads_by_name(tmp_path):
    trained = build(seed=1)
    write_checkpoint(tmp_path / "checkpoints" / "ckpt-000000007", trained)
    record = model_file(CheckpointStore(tmp_path / "checkpoints"), build, tmp_path / "run" / "model.safetensors")
    assert record.flavor == "tensorflow"
    saved = load_file(record.weights)
    assert set(saved) == NAMES
    fresh = record.load()
    assert fresh is not trained
    for mine, theirs in zip(fresh.variables, trained.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(fresh(x), trained(x), rtol=1e-6)


def test_a_file_of_another_model_is_refused_by_name(tmp_path):
    write_checkpoint(tmp_path / "ckpt-000000007", build())
    weights = write_whole_model(tmp_path / "ckpt-000000007", tmp_path / "model.safetensors")
    other = keras.Sequential([keras.Input((3, 4)), keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="holds no 0.bias: it was written for another model"):
        load_whole_model(other, weights)
