"""Models built on the meta device, made real a slice at a time (hvd_runtime.torch.meta_init).

A slice drawn alone equals the same slice of the whole tensor drawn whole, for rows, columns and
both; a generated model of each kind is drawn with its own initialisation (GPT-2's normals,
the layers' kaiming bounds, LayerNorm and BatchNorm constants), tied weights stay one; a GPT split
by apply_tp on the meta device draws, on each tp rank, exactly the rows and columns of the unsplit
model that rank holds, allocating no real tensor larger than what it keeps; a tensor written in
part is refused in one line, and a whole model is built for real by its own constructor.
"""

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hvd_runtime.config import ModelConfig
from hvd_runtime.parallel.tensor_groups import TensorGroup
from hvd_runtime.torch.meta_init import MetaInitError, build_on_meta, draw, is_meta, materialize, take, whole
from hvd_runtime.torch.tensor_parallel import apply_tp
from helpers.tp_checks import load_generated_model

GPT = ModelConfig(width=32, heads=4, layers=2, context=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """build_model of a generated torch project per model kind."""
    import subprocess
    import sys

    found = {}
    for kind in ("gpt", "resnet18", "mlp"):
        out = tmp_path_factory.mktemp(kind)
        subprocess.run([sys.executable, "-m", "hvdgen", "new", "p", "--framework", "torch", "--model", kind,
                        "--output", str(out)], check=True, capture_output=True)
        found[kind] = load_generated_model(out / "p", f"meta_init_{kind}").build_model
    return found


def _linear(rows: int, cols: int) -> nn.Module:
    return build_on_meta(lambda: nn.Linear(cols, rows))


@pytest.mark.parametrize("rows, cols", [(torch.tensor([0, 5, 6, 31]), None), (None, slice(3, 11)),
                                        (torch.tensor([2, 17]), slice(0, 4)), (slice(8, 16), slice(12, 20))])
def test_a_slice_drawn_alone_is_that_slice_of_the_whole_tensor(rows, cols):
    layer = _linear(32, 20)
    full = draw(layer.weight._hvd_held, 7, torch.float32)
    part = take(layer.weight, rows=rows, cols=cols)
    assert part.is_meta
    drawn = draw(part._hvd_held, 7, torch.float32)
    expect = full if rows is None else full[torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows]
    expect = expect if cols is None else expect[:, cols]
    assert torch.equal(drawn, expect)
    # a slice of a slice names the whole tensor's elements
    again = take(part, rows=torch.tensor([1]), cols=slice(1, 3))
    assert torch.equal(draw(again._hvd_held, 7, torch.float32), expect[[1]][:, 1:3])
    # the bias (1-D) and another seed
    bias = draw(layer.bias._hvd_held, 7, torch.float32)
    assert torch.equal(draw(take(layer.bias, rows=slice(4, 9))._hvd_held, 7, torch.float32), bias[4:9])
    assert not torch.equal(draw(layer.weight._hvd_held, 8, torch.float32), full)


def test_draws_follow_the_models_own_initialisation(models):
    gpt = materialize(build_on_meta(models["gpt"], GPT, (8,), 50), seed=0)
    assert not is_meta(gpt)
    assert gpt[-1].out.weight is gpt[0].tokens.weight, "the tied head lost its embedding"
    qkv, proj = gpt[1].qkv.weight, gpt[1].proj.weight
    assert abs(qkv.mean().item()) < 0.002 and qkv.std().item() == pytest.approx(0.02, rel=0.1)
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * GPT.layers), rel=0.1)  # GPT-2's residual scale
    assert torch.equal(gpt[1].norm1.weight, torch.ones(32)) and torch.equal(gpt[1].qkv.bias, torch.zeros(96))

    mlp = materialize(build_on_meta(models["mlp"], ModelConfig(), (784,), 10), seed=0)
    first = next(m for m in mlp.modules() if isinstance(m, nn.Linear))
    bound = 1 / math.sqrt(first.in_features)   # nn.Linear's kaiming_uniform_(a=sqrt(5)) bound
    assert first.weight.abs().max().item() <= bound and first.weight.abs().max().item() > 0.95 * bound

    resnet = materialize(build_on_meta(models["resnet18"], ModelConfig(), (3, 32, 32), 10), seed=0)
    norm = next(m for m in resnet.modules() if isinstance(m, nn.BatchNorm2d))
    assert torch.equal(norm.running_var, torch.ones_like(norm.running_var))
    assert norm.num_batches_tracked.item() == 0 and norm.num_batches_tracked.dtype == torch.long
    assert resnet(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


class _Allocations(TorchDispatchMode):
    """The element count of every real (not meta) tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("tp", [2, 4])
def test_each_tp_rank_draws_exactly_its_slices_of_the_unsplit_model(models, tp):
    unsplit = materialize(build_on_meta(models["gpt"], GPT, (8,), 52), seed=3)
    reference = dict(unsplit.named_parameters())
    held_by_ranks = 0
    for rank in range(tp):
        split = apply_tp(build_on_meta(models["gpt"], GPT, (8,), 52), TensorGroup(rank=rank, size=tp, process_set=None))
        assert is_meta(split)
        with _Allocations() as allocations:
            materialize(split, seed=3)
        params = dict(split.named_parameters())
        held = sum(p.numel() for p in params.values())
        held_by_ranks += held
        assert max(allocations.sizes) <= max(p.numel() for p in params.values()), "a real tensor beyond a held one"
        for name, p in params.items():
            whole_p, module = reference[name], split.get_submodule(name.rpartition(".")[0])
            index = getattr(module, "source_index", None)
            if p.shape == whole_p.shape:
                assert torch.equal(p, whole_p), name
            elif isinstance(module, nn.Module) and type(module).__name__ == "RowParallelLinear":
                assert torch.equal(p, whole_p[:, index]), name
            else:
                assert torch.equal(p, whole_p[index]), name
    kept = sum(p.numel() for name, p in reference.items()
               if dict(split.named_parameters())[name].shape == p.shape)
    assert held_by_ranks == sum(p.numel() for p in reference.values()) + (tp - 1) * kept


def test_a_tensor_written_in_part_is_refused_in_one_line_and_a_whole_model_is_built_for_real():
    def build():
        return nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 4))

    model = build_on_meta(build)
    with pytest.raises(MetaInitError, match=r"^model.py initialises `0.weight` so that it cannot be drawn a slice "
                                            r"at a time: it is written in part .*; initialise it with nn.init's") as e:
        materialize(model, seed=0)
    assert "\n" not in str(e.value)
    real = whole(build_on_meta(build), seed=5)
    assert not is_meta(real) and torch.equal(real[0].weight[0], torch.zeros(4))
    torch.manual_seed(5)
    eager = build()
    assert all(torch.equal(a, b) for a, b in zip(real.state_dict().values(), eager.state_dict().values()))


def test_initialisers_torch_skips_on_meta_are_drawn_or_refused():
    """trunc_normal_, which torch leaves undone on meta tensors, is drawn as torch draws it
    (inside its bounds, the truncated normal's spread); orthogonal_ is refused by name."""
    def build():
        layer = nn.Linear(300, 200)
        nn.init.trunc_normal_(layer.weight, std=0.1, a=-0.15, b=0.15)
        return layer

    drawn = materialize(build_on_meta(build), seed=0).weight
    eager = build().weight
    assert -0.15 <= drawn.min().item() and drawn.max().item() <= 0.15 and drawn.min().item() < -0.149
    assert drawn.std().item() == pytest.approx(eager.std().item(), rel=0.02)

    def rotated():
        layer = nn.Linear(4, 4)
        nn.init.orthogonal_(layer.weight)
        return layer

    with pytest.raises(MetaInitError, match=r"^model.py initialises `weight` .*: nn.init.orthogonal_ is not element-wise"):
        materialize(build_on_meta(rotated), seed=0)
    assert nn.init.orthogonal_.__module__ == "torch.nn.init", "build_on_meta left its stand-in in nn.init"
