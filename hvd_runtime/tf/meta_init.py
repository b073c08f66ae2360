"""Keras models built without values; a rank makes real only the variables it holds, the same at any layout.

    model = build_on_meta(build_model, cfg.model, dataset.input_shape, dataset.num_classes)
    stage = apply_pipeline(model, ...)        # its variables still have shapes and no values
    stage = materialize(stage, seed=cfg.seed)

The TensorFlow side of `hvd_runtime.torch.meta_init`. `build_on_meta` runs the model's own
constructor inside `keras.StatelessScope(initialize_variables=False)`: Keras makes every variable
with its shape, dtype and initializer but no value (read in a graph while Keras infers shapes,
such a variable gives its initializer's symbolic value; nothing is allocated). Each float variable
then carries its name in the whole model (hvd_runtime.tf.names) and a recipe read from its Keras
initializer (`Held`): a constant, or a uniform, normal or truncated normal distribution, the
variance-scaling ones (Glorot, He, LeCun) with their fans from the whole variable's shape.

`materialize` draws what a module holds from the recipes. Random values are a function of the
run's seed, the variable's name in the whole model and each element's index in the whole
variable (a counter-based generator: splitmix64 of the index, Box-Muller for normals, the inverse
error function for truncated normals), so a rank holding columns 512..1023 of a kernel draws
exactly those columns of the whole model's, without the others: unsplit, any pipeline cut and
any tensor-parallel split start from the same model, and no rank allocates a variable, or a slice
of one, that it does not hold. `take` is how tensor parallelism makes a split layer's variable
from a meta one (its rows and/or columns of the whole one).

An initializer that is not element-wise (Orthogonal, Identity, a function of model.py's own) is
said in one line naming the variable (`MetaInitError`). A model every rank holds whole is given
its own initializers' values (`whole`): the values building it for real would have given.
Integer variables (Dropout's seed states) always take their own initializers' values.

Keras has no public way to give a deferred variable its value: `_value`, `_initialize` and
`_initializer` are the Keras 3 variable's own (keras 3.15).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import keras
import numpy as np

from hvd_runtime.tf.names import is_state, whole_names

__all__ = ["Held", "MetaInitError", "build_on_meta", "draw", "is_meta", "made_real", "materialize", "take", "whole"]

_CHUNK = 1 << 22   # elements drawn at a time: the generator's temporaries stay a few of these
_TRUNCATED_STD = 0.87962566103423978   # the standard deviation of a unit normal truncated at +-2


class MetaInitError(ValueError):
    """A variable whose initialisation cannot be drawn a slice at a time."""


@dataclass(frozen=True)
class Recipe:
    """How a variable's values are made: `kind` fill (a), uniform (a, b the bounds), normal or
    truncated (a the mean, b the standard deviation; truncated at 2 of them). `unknown`: why it
    cannot be drawn."""

    kind: str = "fill"
    a: float = 0.0
    b: float = 0.0
    unknown: str | None = None


def recipe_of(initializer, shape: tuple[int, ...]) -> Recipe:
    """The recipe of a Keras initializer for a variable of the whole `shape`."""
    from keras import initializers as k
    from keras.src.initializers.random_initializers import compute_fans

    if isinstance(initializer, k.Zeros):
        return Recipe("fill", 0.0)
    if isinstance(initializer, k.Ones):
        return Recipe("fill", 1.0)
    if isinstance(initializer, k.Constant):
        value = np.asarray(initializer.value)
        return Recipe("fill", float(value)) if value.size == 1 else Recipe(unknown="a Constant of many values")
    if isinstance(initializer, k.RandomUniform):
        return Recipe("uniform", float(initializer.minval), float(initializer.maxval))
    if isinstance(initializer, k.TruncatedNormal):
        return Recipe("truncated", float(initializer.mean), float(initializer.stddev))
    if isinstance(initializer, k.RandomNormal):
        return Recipe("normal", float(initializer.mean), float(initializer.stddev))
    if isinstance(initializer, k.VarianceScaling):
        fan_in, fan_out = compute_fans(shape, input_axes=initializer.input_axes, output_axes=initializer.output_axes)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[initializer.mode]
        scale = initializer.scale / max(1.0, fan)
        if initializer.distribution == "truncated_normal":
            return Recipe("truncated", 0.0, math.sqrt(scale) / _TRUNCATED_STD)
        if initializer.distribution == "untruncated_normal":
            return Recipe("normal", 0.0, math.sqrt(scale))
        limit = math.sqrt(3.0 * scale)
        return Recipe("uniform", -limit, limit)
    return Recipe(unknown=f"its initializer {type(initializer).__name__} is not element-wise")


@dataclass(frozen=True)
class Held:
    """What a meta variable is of the whole model: its name there, whole shape, recipe, and which
    of its rows (dim 0) and columns (dim 1) this variable holds (None: all)."""

    name: str
    shape: tuple[int, ...]
    recipe: Recipe
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None

    def part(self, rows=None, cols=None) -> "Held":
        """This variable's slice: `rows` index its own rows, `cols` its own columns."""
        rows = self.rows if rows is None else (np.asarray(rows) if self.rows is None else self.rows[rows])
        cols = self.cols if cols is None else (np.asarray(cols) if self.cols is None else self.cols[cols])
        return Held(self.name, self.shape, self.recipe, rows, cols)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.rows is not None:
            shape[0] = len(self.rows)
        if self.cols is not None:
            shape[1] = len(self.cols)
        return tuple(shape)


def is_meta(obj) -> bool:
    """Whether a variable has no value yet, or any variable of a layer, model or stage."""
    if isinstance(obj, keras.Variable):
        return obj._value is None
    return any(v._value is None for v in obj.variables)


def _forget(variables) -> None:
    """Out of Keras' list of variables to initialise when a stateless scope closes: their values
    come from here, or from nowhere on a rank that does not hold them."""
    from keras.src.backend.common import global_state

    mine = {id(v) for v in variables}
    pending = global_state.get_global_attribute("uninitialized_variables", [])
    global_state.set_global_attribute("uninitialized_variables", [v for v in pending if id(v) not in mine])


@contextlib.contextmanager
def _deferred():
    """Variables made inside have no values (and stay so when the scope closes); yields their list."""
    from keras.src.backend.common import global_state

    before = {id(v) for v in global_state.get_global_attribute("uninitialized_variables", [])}
    made: list = []
    with keras.StatelessScope(initialize_variables=False):
        yield made
    made.extend(v for v in global_state.get_global_attribute("uninitialized_variables", []) if id(v) not in before)
    _forget(made)


def build_on_meta(build: Callable[..., keras.Model], *args, **kwargs) -> keras.Model:
    """build(*args, **kwargs) with no variable's value, each float variable carrying its `Held`:
    its name in the whole model and how it is initialised. Costs no memory for the variables."""
    with _deferred() as made:
        model = build(*args, **kwargs)
    names = whole_names(model)
    for v in model.variables:
        if id(v) in names:
            v._hvd_held = Held(names[id(v)], tuple(v.shape), recipe_of(v._initializer, tuple(v.shape)))
    model._hvd_deferred = made   # every variable the build made, whole() gives them their values
    return model


def _held(v) -> Held:
    held = getattr(v, "_hvd_held", None)
    if held is None:
        raise MetaInitError(f"variable {v.path} of shape {tuple(v.shape)} has no value and was not made by "
                            "build_on_meta or take: there is no recipe to draw it from")
    return held


def take(layer: keras.layers.Layer, source, name: str, rows=None, cols=None):
    """A new variable of `layer`, `source`'s `rows` (dim 0) and/or `cols` (dim 1), index arrays
    (None: all): of a meta `source`, a meta variable holding that slice of the whole one; of a
    real one, a copy of its values."""
    part = Held("", tuple(source.shape), Recipe()).part(rows, cols)
    if not is_meta(source):
        values = source.numpy()
        values = values if rows is None else values[part.rows]
        values = values if cols is None else values[:, part.cols]
        out = layer.add_weight(shape=values.shape, initializer="zeros", name=name)
        out.assign(values)
        return out
    with _deferred():
        out = layer.add_weight(shape=part.local_shape, initializer="zeros", name=name)
    out._hvd_held = _held(source).part(rows, cols)
    return out


def _give(v, values) -> None:
    v._initialize(values)
    v._initializer = None


def materialize(module, seed: int):
    """Give `module`'s (a layer, model or stage) meta variables their values, in place: each float
    one drawn from its recipe (the seed, its name in the whole model, its elements' indices), the
    others (integer seed states) their own initializers'. Variables with values are left as they
    are; a variable reached twice (tied) is made once. Returns `module`."""
    for v in module.variables:
        if is_meta(v):
            _give(v, draw(_held(v), seed, v.dtype) if is_state(v) else v._initializer(v.shape, dtype=v.dtype))
    return module


def whole(model: keras.Model) -> keras.Model:
    """The whole model made real, where every rank holds it whole (data parallel, model-split,
    elastic): each variable its own initializer's values, as building it for real gives."""
    for v in getattr(model, "_hvd_deferred", model.variables):
        if is_meta(v):
            _give(v, v._initializer(v.shape, dtype=v.dtype))
    return model


@contextlib.contextmanager
def made_real(layer):
    """`layer`'s meta variables given values (their own initializers') while inside, and none
    again after: what rank 0 times a meta layer on, one layer at a time."""
    given = [v for v in layer.variables if is_meta(v)]
    for v in given:
        v._initialize(v._initializer(v.shape, dtype=v.dtype))
    try:
        yield layer
    finally:
        for v in given:
            v._value = None


def draw(held: Held, seed: int, dtype="float32") -> np.ndarray:
    """The values of the slice `held` names of its whole variable (the same on any machine:
    integer arithmetic, then float64)."""
    recipe = held.recipe
    if recipe.unknown:
        raise MetaInitError(f"model.py initialises `{held.name}` so that it cannot be drawn a slice at a time: "
                            f"{recipe.unknown}; use Keras' element-wise initializers (RandomNormal, "
                            "RandomUniform, TruncatedNormal, Zeros, Ones, Constant, the Glorot, He and LeCun ones)")
    dtype = np.dtype(str(dtype))
    shape = held.local_shape
    if recipe.kind == "fill":
        return np.full(shape, recipe.a, dtype)
    whole_shape = held.shape or (1,)
    rows = held.rows if held.rows is not None else np.arange(whole_shape[0])
    per_row, per_col = math.prod(whole_shape[1:]), math.prod(whole_shape[2:])
    if len(whole_shape) > 1 and held.cols is not None:
        within = (held.cols[:, None] * per_col + np.arange(per_col)[None, :]).reshape(-1)
    else:
        within = np.arange(per_row)
    out = np.empty((len(rows), len(within)), dtype)
    key = _key(seed, held.name)
    step = max(1, _CHUNK // max(1, len(within)))
    for start in range(0, len(rows), step):
        index = (rows[start:start + step, None].astype(np.uint64) * np.uint64(per_row)
                 + within[None, :].astype(np.uint64))
        out[start:start + step] = _distribution(recipe, index, key)
    return out.reshape(shape)


def _distribution(recipe: Recipe, index: np.ndarray, key: np.uint64) -> np.ndarray:
    if recipe.kind == "uniform":
        return recipe.a + (recipe.b - recipe.a) * _uniform(index, key)
    if recipe.kind == "normal":
        u1, u2 = _uniform(2 * index, key), _uniform(2 * index + np.uint64(1), key)
        return recipe.a + recipe.b * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
    # truncated at 2 standard deviations: uniform between the bounds' quantiles, then the inverse CDF
    import tensorflow as tf

    bound = math.erf(2.0 / math.sqrt(2.0))
    u = -bound + 2.0 * bound * _uniform(index, key)
    return recipe.a + recipe.b * math.sqrt(2.0) * tf.math.erfinv(tf.constant(u, tf.float64)).numpy()


_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _uniform(index: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64 of key + (index + 1) x golden ratio: uniform float64 in (0, 1), one per index."""
    with np.errstate(over="ignore"):
        z = (index + np.uint64(1)) * _GOLDEN + key
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _key(seed: int, name: str) -> np.uint64:
    """A 64-bit stream per (seed, variable name)."""
    return np.uint64(int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little"))
