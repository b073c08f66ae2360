"""Keras models built without values, made real a slice at a time (hvd_runtime.tf.meta_init).

A slice drawn alone equals the same slice of the whole variable drawn whole, for rows, columns
and both; a generated model of each kind is drawn with its own initializers' distributions
(GPT-2's normals, Glorot's and He's bounds from the whole shape, LayerNorm and BatchNorm
constants), its tied head still tied; a GPT split the way apply_tp splits it draws, on each tp
rank, exactly the rows and columns of the whole model that rank holds, and gives no variable of
the whole model a value; an initializer that is not element-wise is refused in one line, and a
whole model takes its own initializers' values, those of a model built for real.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from hvd_runtime.config import ModelConfig  # noqa: E402
from hvd_runtime.parallel.tensor_groups import TensorGroup  # noqa: E402
from hvd_runtime.tf.meta_init import MetaInitError, build_on_meta, draw, is_meta, materialize, take, whole  # noqa: E402
from hvd_runtime.tf.names import whole_names  # noqa: E402
from hvd_runtime.tf.stage import Stage  # noqa: E402
from hvd_runtime.tf.tensor_parallel import slice_layers  # noqa: E402
from hvd_runtime.tf.tensor_state import SlicedVariables  # noqa: E402
from helpers.tp_checks import load_generated_model  # noqa: E402

GPT = ModelConfig(width=32, heads=4, layers=2, context=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """build_model of a generated TensorFlow project per model kind."""
    found = {}
    for kind in ("gpt", "resnet18", "mlp"):
        out = tmp_path_factory.mktemp(kind)
        subprocess.run([sys.executable, "-m", "hvdgen", "new", "p", "--framework", "tensorflow", "--model", kind,
                        "--output", str(out)], check=True, capture_output=True)
        found[kind] = load_generated_model(out / "p", f"tf_meta_init_{kind}").build_model
    return found


def _dense(inputs: int, units: int) -> keras.Sequential:
    return build_on_meta(lambda: keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(units)]))


@pytest.mark.parametrize("rows, cols", [([0, 5, 6, 19], None), (None, [3, 4, 30, 31]), ([2, 17], [0, 1, 2, 3]),
                                        (list(range(8, 16)), list(range(12, 20)))])
def test_a_slice_drawn_alone_is_that_slice_of_the_whole_variable(rows, cols):
    model = _dense(20, 32)
    kernel = model.layers[0].kernel
    assert is_meta(model) and kernel._value is None
    full = draw(kernel._hvd_held, 7)
    limit = math.sqrt(6 / (20 + 32))   # Dense's Glorot uniform, fans of the whole kernel
    assert np.abs(full).max() <= limit and np.abs(full).max() > 0.95 * limit
    holder = keras.layers.Layer()
    part = take(holder, kernel, "kernel", rows=rows, cols=cols)
    assert is_meta(part)
    expect = full if rows is None else full[rows]
    expect = expect if cols is None else expect[:, cols]
    assert np.array_equal(draw(part._hvd_held, 7), expect)
    # a slice of a slice names the whole variable's elements
    again = take(holder, part, "again", rows=[1], cols=[1, 2])
    assert np.array_equal(draw(again._hvd_held, 7), expect[[1]][:, 1:3])
    assert not np.array_equal(draw(kernel._hvd_held, 8), full)


def test_draws_follow_the_models_own_initializers(models):
    gpt = materialize(build_on_meta(models["gpt"], GPT, (8,), 50), seed=0)
    assert not is_meta(gpt)
    embedding, block, head = gpt.layers[0], gpt.layers[1], gpt.layers[-1]
    assert head.tied_to is embedding.tokens, "the tied head lost its embedding"
    qkv, proj = block.qkv.kernel.numpy(), block.proj.kernel.numpy()
    assert abs(qkv.mean()) < 0.002 and qkv.std() == pytest.approx(0.02, rel=0.1)
    assert proj.std() == pytest.approx(0.02 / math.sqrt(2 * GPT.layers), rel=0.1)   # GPT-2's residual scale
    assert np.array_equal(block.norm1.gamma.numpy(), np.ones(32)) and np.array_equal(block.qkv.bias.numpy(),
                                                                                       np.zeros(96))
    assert gpt(np.zeros((2, 8), "int64")).shape == (2, 8, 50)

    mlp = materialize(build_on_meta(models["mlp"], ModelConfig(), (28, 28), 10), seed=0)
    first = next(layer for layer in mlp.layers if isinstance(layer, keras.layers.Dense))
    fan_in, fan_out = first.kernel.shape
    bound = math.sqrt(6 / (fan_in + fan_out))
    assert np.abs(first.kernel.numpy()).max() <= bound and np.abs(first.kernel.numpy()).max() > 0.95 * bound

    resnet = materialize(build_on_meta(models["resnet18"], ModelConfig(), (32, 32, 3), 10), seed=0)
    norm = next(v for v in resnet.variables if "moving_variance" in v.path)
    assert np.array_equal(norm.numpy(), np.ones(norm.shape))
    assert resnet(np.zeros((2, 32, 32, 3), "float32")).shape == (2, 10)


def test_truncated_normals_stay_within_two_standard_deviations():
    """TruncatedNormal, and He normal (variance scaling, truncated): inside +-2 of the untruncated
    standard deviation, with the spread of the distribution."""
    model = build_on_meta(lambda: keras.Sequential([
        keras.Input((400,)), keras.layers.Dense(300, kernel_initializer=keras.initializers.TruncatedNormal(1.0, 0.5)),
        keras.layers.Dense(200, kernel_initializer="he_normal")]))
    truncated, he = (draw(layer.kernel._hvd_held, 3) for layer in model.layers)
    assert truncated.min() >= 0.0 and truncated.max() <= 2.0 and truncated.min() < 0.01 and truncated.max() > 1.99
    assert truncated.mean() == pytest.approx(1.0, abs=0.01) and truncated.std() == pytest.approx(0.5 * 0.87962566,
                                                                                                   rel=0.02)
    assert he.std() == pytest.approx(math.sqrt(2 / 300), rel=0.02)   # He's target after truncation: sqrt(2 / fan_in)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_tp_rank_draws_exactly_its_slices_of_the_unsplit_model(models, tp):
    unsplit = materialize(build_on_meta(models["gpt"], GPT, (8,), 52), seed=3)
    reference = {name: v.numpy() for name, v in ((whole_names(unsplit)[id(v)], v) for v in unsplit.variables
                                                  if id(v) in whole_names(unsplit))}
    held_by_ranks = 0
    for rank in range(tp):
        meta = build_on_meta(models["gpt"], GPT, (8,), 52)
        # rank's layers of the group, as a stage (a Sequential of them would reach for the group's collectives)
        split = Stage(slice_layers(meta.layers, TensorGroup(rank, tp, None)), 0, None)
        assert is_meta(split)
        materialize(split, seed=3)
        assert is_meta(meta), "the whole model was given values"
        cuts, names = SlicedVariables(split).by_id, whole_names(split)
        for v in split.variables:
            if id(v) not in names:
                continue
            name, cut = names[id(v)], cuts.get(id(v))
            expect = reference[name] if cut is None else np.take(reference[name], cut.index, axis=cut.axis)
            assert np.array_equal(v.numpy(), expect), name
            held_by_ranks += int(np.prod(v.shape))
        whole_held = sum(int(np.prod(v.shape)) for v in split.variables if id(v) in names and id(v) not in cuts)
    # every rank holds the variables kept whole; the split ones' slices add up to them once
    assert held_by_ranks == sum(a.size for a in reference.values()) + (tp - 1) * whole_held


def test_an_initializer_not_element_wise_is_refused_in_one_line_and_a_whole_model_is_its_own():
    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, kernel_initializer="orthogonal"),
                                 keras.layers.Dense(3)])

    with pytest.raises(MetaInitError, match=r"^model.py initialises `0.kernel` so that it cannot be drawn a slice "
                                            r"at a time: its initializer Orthogonal is not element-wise; use") as e:
        materialize(build_on_meta(build), seed=0)
    assert "\n" not in str(e.value)
    keras.utils.set_random_seed(5)
    real = whole(build_on_meta(build))
    assert not is_meta(real)
    keras.utils.set_random_seed(5)
    eager = build()
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(real.variables, eager.variables))
