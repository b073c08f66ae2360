"""Models built on the meta device; a rank makes real only the parameters it holds, the same at any layout.

    model = build_on_meta(build_model, cfg.model, dataset.input_shape, dataset.num_classes)
    stage = build_stage(model, place, partition="params")    # still meta: shapes, no memory
    stage = materialize(stage, seed=cfg.seed, device=ctx.device)

`build_on_meta` runs the model's own constructor under `torch.device("meta")` with a dispatch mode
that writes down how each tensor is initialised: the in-place element-wise operations nn.init
and the layers' `reset_parameters` apply to it (uniform_, normal_, fill_, zero_, then scalar
mul_, add_, clamp_, erfinv_ ...), from the last one that overwrites every element. Each meta
parameter and buffer then carries that recipe and its name in the whole model (`Held`).

`materialize` draws what a module holds from its recipes. Random values are a function of the
run's seed, the tensor's name in the whole model and each element's index in the whole tensor
(a counter-based generator: splitmix64 of the index, Box-Muller for normals), so a rank holding
rows 512..1023 of a weight draws exactly those rows of the whole model's, without the others:
unsplit, any pipeline cut and any tensor-parallel split start from the same model, and no rank
allocates a parameter, or a slice of one, that it does not hold. `take` is how tensor
parallelism slices a meta parameter (rows and/or columns of the whole one).

What cannot be drawn a slice at a time (a tensor written in part, as nn.Embedding's padding row,
or by a non-element-wise operation, as orthogonal_) is said in one line naming the tensor
(`MetaInitError`). A model that every rank holds whole is built for real by its own constructor
under the seed (`whole`): nothing to save there, and its values stay the model's own draws.
torch skips trunc_normal_, orthogonal_, dirac_ and sparse_ on meta tensors; while the model is
built, nn.init's own are replaced by the recorder's (trunc_normal_'s recipe; the others
refused), so only a copy of them taken before the build (`from torch.nn.init import orthogonal_`
at import) would go unseen. A tensor made empty and never written draws zeros.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Held", "MetaInitError", "build_on_meta", "is_meta", "materialize", "real_copy", "take", "whole"]

_aten = torch.ops.aten
# Operations that set every element whatever it held before: a recipe starts at the last of them.
_OVERWRITE = {_aten.uniform_.default: "uniform", _aten.normal_.default: "normal", _aten.fill_.Scalar: "fill",
              _aten.zero_.default: "zero"}
_FACTORIES = {_aten.zeros.default: ("zero", ()), _aten.ones.default: ("fill", (1,)),
              _aten.empty.memory_format: ("zero", ()), _aten.empty_strided.default: ("zero", ()),
              _aten.full.default: ("fill", None), _aten.scalar_tensor.default: ("fill", None),
              _aten.randn.default: ("normal", ()), _aten.rand.default: ("uniform", ())}
# Element-wise in place with scalar arguments: applied to whatever the recipe drew so far.
_ELEMENTWISE = {_aten.mul_.Scalar: torch.Tensor.mul_, _aten.mul_.Tensor: torch.Tensor.mul_,
                _aten.add_.Scalar: torch.Tensor.add_, _aten.add_.Tensor: torch.Tensor.add_,
                _aten.sub_.Scalar: torch.Tensor.sub_, _aten.sub_.Tensor: torch.Tensor.sub_,
                _aten.div_.Scalar: torch.Tensor.div_, _aten.div_.Tensor: torch.Tensor.div_,
                _aten.clamp_.default: torch.Tensor.clamp_, _aten.erfinv_.default: torch.Tensor.erfinv_,
                _aten.neg_.default: torch.Tensor.neg_, _aten.abs_.default: torch.Tensor.abs_}
# The same out of place (`torch.randn(n, m) * 0.02`): the result's recipe is its input's, then the operation.
_OUT_OF_PLACE = {_aten.mul.Tensor: _aten.mul_.Tensor, _aten.mul.Scalar: _aten.mul_.Scalar,
                 _aten.add.Tensor: _aten.add_.Tensor, _aten.add.Scalar: _aten.add_.Scalar,
                 _aten.sub.Tensor: _aten.sub_.Tensor, _aten.div.Tensor: _aten.div_.Tensor,
                 _aten.div.Scalar: _aten.div_.Scalar, _aten.neg.default: _aten.neg_.default}
_COPIES = {_aten.clone.default, _aten._to_copy.default, _aten.lift_fresh_copy.default}
_CHUNK = 1 << 22   # elements drawn at a time: the generator's temporaries stay a few of these


class MetaInitError(ValueError):
    """A tensor whose initialisation cannot be drawn a slice at a time."""


@dataclass(frozen=True)
class Recipe:
    """How a tensor's values are made: a first operation that sets every element (`start`, its
    arguments), then element-wise ones with scalar arguments. `unknown`: why it cannot be drawn."""

    start: str = "zero"
    args: tuple = ()
    then: tuple = ()
    unknown: str | None = None

    @property
    def random(self) -> bool:
        return self.start in ("uniform", "normal")


@dataclass
class Held:
    """What a meta tensor is of the whole model: its name there, whole shape, recipe, and which of
    its rows (dim 0) and columns (dim 1) this tensor holds (None: all)."""

    name: str
    shape: tuple[int, ...]
    recipe: Recipe
    rows: torch.Tensor | None = None
    cols: slice | None = None

    def part(self, rows: torch.Tensor | None = None, cols: slice | None = None) -> "Held":
        """This tensor's slice: `rows` indexes its own rows, `cols` its own columns."""
        new_rows = self.rows if rows is None else (rows if self.rows is None else self.rows[rows])
        if cols is None:
            new_cols = self.cols
        else:
            base = self.cols.start if self.cols is not None else 0
            new_cols = slice(base + cols.start, base + cols.stop)
        return Held(self.name, self.shape, self.recipe, new_rows, new_cols)


class _Recorder(TorchDispatchMode):
    """Writes down, per storage, the recipe of every meta tensor made or changed while it is active."""

    def __init__(self):
        super().__init__()
        self.recipes: dict[int, tuple[torch.Tensor, Recipe]] = {}   # storage -> (a tensor keeping it alive, recipe)

    @staticmethod
    def _key(t) -> int | None:
        return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) and t.is_meta else None

    def recipe_of(self, t: torch.Tensor) -> Recipe:
        found = self.recipes.get(self._key(t))
        return found[1] if found else Recipe(unknown="it is made by an operation that cannot be replayed")

    def _set(self, t: torch.Tensor, recipe: Recipe) -> None:
        self.recipes[self._key(t)] = (t, recipe)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES and isinstance(out, torch.Tensor) and out.is_meta:
            start, fixed = _FACTORIES[func]
            value = fixed if fixed is not None else (args[1] if func is _aten.full.default else args[0],)
            self._set(out, Recipe(start, tuple(value)))
        elif func in _COPIES and self._key(args[0]) in self.recipes and out.is_meta:
            self._set(out, self.recipe_of(args[0]))
        elif (func in _OUT_OF_PLACE and self._key(args[0]) in self.recipes and isinstance(out, torch.Tensor)
              and self._key(out) not in (self._key(a) for a in args)):
            self._set(out, self.recipe_of(args[0]))
            self._set(out, self._changed(_OUT_OF_PLACE[func], out, args[1:], kwargs))
        elif func in _OVERWRITE or func in _ELEMENTWISE or func is _aten.copy_.default:
            target = args[0]
            if self._key(target) is not None:
                self._set(target, self._changed(func, target, args[1:], kwargs))
        else:   # any other operation that writes into a tensor leaves it undrawable
            for argument, value in zip(func._schema.arguments, [*args, *kwargs.values()]):
                if argument.alias_info is not None and argument.alias_info.is_write and self._key(value) is not None:
                    self._set(value, Recipe(unknown=f"it is written by aten.{func.__name__}"))
        return out

    def trunc_normal(self, tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator=None):
        """nn.init.trunc_normal_'s recipe (torch skips it on the meta device): uniform between the
        bounds' normal quantiles, then the inverse error function, scaled, shifted and clamped."""
        low, high = (math.erf((bound - mean) / std / math.sqrt(2.0)) for bound in (a, b))
        self._set(tensor, Recipe("uniform", (low, high), ((_aten.erfinv_.default, ()),
                                                          (_aten.mul_.Tensor, (std * math.sqrt(2.0),)),
                                                          (_aten.add_.Tensor, (mean,)),
                                                          (_aten.clamp_.default, (a, b)))))
        return tensor

    def refused(self, name: str):
        """An initialiser torch skips on the meta device and that is not element-wise."""
        def initialise(tensor, *args, **kwargs):
            self._set(tensor, Recipe(unknown=f"nn.init.{name} is not element-wise"))
            return tensor
        return initialise

    def _changed(self, func, target: torch.Tensor, args: tuple, kwargs: dict) -> Recipe:
        before = self.recipe_of(target)
        whole = (target.storage_offset() == 0 and target.is_contiguous()
                 and target.numel() * target.element_size() == target.untyped_storage().nbytes())
        if not whole:
            return Recipe(unknown=f"it is written in part (aten.{func.__name__} on a slice of it)")
        if func is _aten.copy_.default:
            source = args[0]
            if self._key(source) in self.recipes:
                return self.recipe_of(source)
            return Recipe(unknown="it is copied from a tensor made by an operation that cannot be replayed")
        if any(isinstance(a, torch.Tensor) and a.numel() != 1 for a in args):
            return Recipe(unknown=f"aten.{func.__name__} with a tensor argument is not element-wise")
        if kwargs.get("alpha", 1) != 1:
            return Recipe(unknown=f"aten.{func.__name__} with alpha={kwargs['alpha']}")
        scalars = tuple(a.item() if isinstance(a, torch.Tensor) and not a.is_meta else a for a in args)
        if any(isinstance(a, torch.Tensor) for a in scalars):
            return Recipe(unknown=f"aten.{func.__name__} with a meta tensor argument")
        if func in _OVERWRITE:
            return Recipe(_OVERWRITE[func], scalars)
        return Recipe(before.start, before.args, before.then + ((func, scalars),), before.unknown)


def build_on_meta(build: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """build(*args, **kwargs) on the meta device, each parameter and buffer carrying its `Held`:
    its name in the whole model and how it is initialised. Costs no memory for the tensors."""
    recorder = _Recorder()
    # nn.init skips these on meta tensors without a word: the recorder stands in for them meanwhile
    standing_in = {"_no_grad_trunc_normal_": recorder.trunc_normal,
                   **{name: recorder.refused(name) for name in ("orthogonal_", "dirac_", "sparse_", "eye_")}}
    originals = {name: getattr(nn.init, name) for name in standing_in}
    try:
        for name, stand_in in standing_in.items():
            setattr(nn.init, name, stand_in)
        with torch.device("meta"), recorder:
            model = build(*args, **kwargs)
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)
    seen = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in seen:           # a tied parameter keeps the first name it has
            seen.add(id(t))
            t._hvd_held = Held(name, tuple(t.shape), recorder.recipe_of(t))
    model._hvd_build = lambda: build(*args, **kwargs)
    return model


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is still on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def take(param: nn.Parameter, rows: torch.Tensor | slice | None = None, cols: slice | None = None) -> nn.Parameter:
    """A new parameter of `param`'s `rows` (dim 0) and/or `cols` (dim 1): on the meta device it is
    only a shape and the slice it holds of the whole tensor; a real one copies its values."""
    if isinstance(rows, slice):
        rows = torch.arange(rows.start, rows.stop)
    if not param.is_meta:
        t = param.detach()
        t = t if rows is None else t[rows.to(t.device)]
        return nn.Parameter((t if cols is None else t[:, cols]).clone(), requires_grad=param.requires_grad)
    shape = list(param.shape)
    if rows is not None:
        shape[0] = len(rows)
    if cols is not None:
        shape[1] = cols.stop - cols.start
    out = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)
    out._hvd_held = _held(param).part(rows, cols)
    return out


def _held(t: torch.Tensor) -> Held:
    held = getattr(t, "_hvd_held", None)
    if held is None:
        raise MetaInitError(f"a meta tensor of shape {tuple(t.shape)} was not made by build_on_meta or take: "
                            "there is no recipe to draw it from")
    return held


def materialize(module: nn.Module, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Make `module`'s meta parameters and buffers real on `device`, in place, each drawn from its
    recipe (the seed, its name in the whole model, its elements' indices). Tied parameters stay
    one. Tensors already real are left as they are. Returns `module`."""
    made: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for table, wrap in ((owner._parameters, True), (owner._buffers, False)):
            for key, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    values = draw(_held(t), seed, t.dtype, device)
                    made[id(t)] = nn.Parameter(values, requires_grad=t.requires_grad) if wrap else values
                table[key] = made[id(t)]
    return module


def real_copy(module: nn.Module, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """A real copy of `module` (its meta tensors drawn, as materialize would draw them in place);
    `module` itself stays as it is. What rank 0 times a meta block on, one block at a time."""
    copied = copy.deepcopy(module)
    for original, twin in zip([*module.parameters(), *module.buffers()], [*copied.parameters(), *copied.buffers()]):
        if original.is_meta:
            twin._hvd_held = _held(original)
    return materialize(copied, seed, device)


def whole(model: nn.Module, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model made real, where every rank holds it whole (data parallel, model-split):
    built again by the model's own constructor under the seed, so its values are the ones the
    model's own initialisation gives; drawn from the recipes only for a model build_on_meta did
    not build."""
    if not is_meta(model):
        return model
    if hasattr(model, "_hvd_build"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return model._hvd_build().to(device)
    return materialize(model, seed, device)


def draw(held: Held, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The values of the slice `held` names of its whole tensor, computed on `device` (the same
    values on any device, to float64 rounding: integer arithmetic, then float64)."""
    recipe = held.recipe
    if recipe.unknown:
        raise MetaInitError(f"model.py initialises `{held.name}` so that it cannot be drawn a slice at a time: "
                            f"{recipe.unknown}; initialise it with nn.init's element-wise functions (normal_, "
                            "uniform_, constant_, zeros_, the kaiming and xavier ones)")
    shape = list(held.shape)
    if held.rows is not None:
        shape[0] = len(held.rows)
    if held.cols is not None:
        shape[1] = held.cols.stop - held.cols.start
    out = torch.empty(shape, dtype=dtype, device=device)
    if not recipe.random:
        out.fill_(recipe.args[0] if recipe.start == "fill" else 0)
    else:
        _draw_random(out, held, recipe, _key(seed, held.name))
    for op, scalars in recipe.then:
        _ELEMENTWISE[op](out, *scalars)
    return out


def _draw_random(out: torch.Tensor, held: Held, recipe: Recipe, key: int) -> None:
    """Fill `out` with `recipe`'s distribution at the whole tensor's element indices it holds, a
    few rows at a time (the generator's temporaries stay within a chunk)."""
    whole_shape = held.shape
    row_size = math.prod(whole_shape[1:]) if len(whole_shape) > 1 else 1
    flat = out.view(out.shape[0], -1) if out.dim() > 1 else out.view(-1, 1)
    if out.dim() == 0:
        flat = out.view(1, 1)
    device = out.device
    rows = held.rows.to(device) if held.rows is not None else torch.arange(flat.shape[0], device=device)
    if held.cols is not None:
        per_col = math.prod(whole_shape[2:])
        within = torch.arange(held.cols.start * per_col, held.cols.stop * per_col, device=device)
    else:
        within = torch.arange(flat.shape[1], device=device)
    step = max(1, _CHUNK // max(1, len(within)))
    for start in range(0, len(rows), step):
        index = rows[start:start + step, None] * row_size + within[None, :]
        values = _distribution(recipe, index, key)
        flat[start:start + step].copy_(values)


def _distribution(recipe: Recipe, index: torch.Tensor, key: int) -> torch.Tensor:
    if recipe.start == "uniform":
        low, high = (list(recipe.args) + [0.0, 1.0][len(recipe.args):])[:2]
        return low + (high - low) * _uniform(index, key)
    mean, std = (list(recipe.args) + [0.0, 1.0][len(recipe.args):])[:2]
    u1, u2 = _uniform(2 * index, key), _uniform(2 * index + 1, key)
    return mean + std * torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _uniform(index: torch.Tensor, key: int) -> torch.Tensor:
    """splitmix64 of key + (index + 1) x golden ratio: uniform float64 in (0, 1), one per index."""
    z = (index + 1) * _GOLDEN + key
    z = (z ^ _shift(z, 30)) * _M1
    z = (z ^ _shift(z, 27)) * _M2
    z = z ^ _shift(z, 31)
    return (_shift(z, 11).double() + 0.5) * (1.0 / (1 << 53))


def _key(seed: int, name: str) -> int:
    """A 64-bit stream per (seed, tensor name)."""
    return _signed(int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little"))
