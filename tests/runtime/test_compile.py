"""train.compile (hvd_runtime.torch.compile): a compiled step is the eager step, and a model that
does not compile trains eager after one warning.

Each generated torch model (the MLP, ResNet-18, the GPT, small) trains one step compiled by
torch.compile's default backend (inductor, C++ on this CPU) and one eager, from the same weights
on the same batch: losses, gradients and updated weights within 1e-5 (fp32). The warm-up leaves
the model as it found it: BatchNorm's statistics and the RNG. A backend that cannot compile
stands for any compilation failure (a graph it cannot lower, a missing compiler).

ResNet-18 at width 8: at width 4 (4 channels), inductor's CPU code for torch 2.13 gives other
gradients than eager for some batches (up to 3% apart, the loss equal; aot_eager agrees with
eager, and widths 8 and 16 agree), an upstream difference, not the warm-up's.

Cost: the three models' compilations (about 20 s each, one core) when inductor's cache is cold.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from hvd_runtime.config import ConfigError, ModelConfig
from hvd_runtime.torch.compile import compile_model, wanted
from hvdgen.render import render_tree
from hvdgen.spec import ProjectSpec
from helpers.tp_checks import load_generated_model

SIZES = {"mlp": (ModelConfig(), (64,), 10),
         "resnet18": (ModelConfig(width=8), (3, 16, 16), 10),   # width 4: see the docstring
         "gpt": (ModelConfig(width=32, heads=2, layers=2, context=16), (16,), 64)}


def one_rank(problem):
    return [problem]


def batch(kind: str, shape, classes: int):
    generator = torch.Generator().manual_seed(1)
    if kind == "gpt":
        x = torch.randint(0, classes, (8, *shape), generator=generator)
        return x, torch.roll(x, -1, dims=1)
    return torch.randn((8, *shape), generator=generator), torch.randint(0, classes, (8,), generator=generator)


def step(model: nn.Module, x, y, lr: float = 0.1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One SGD step's loss and gradients; the weights updated in place."""
    model.train()
    out = model(x)
    loss = nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("kind", list(SIZES))
def test_a_compiled_step_is_the_eager_step(tmp_path, monkeypatch, kind):
    render_tree(ProjectSpec(name="p", model=kind), tmp_path)
    cfg, shape, classes = SIZES[kind]
    generated = load_generated_model(tmp_path, f"compile_{kind}")
    monkeypatch.setitem(sys.modules, f"compile_{kind}", generated)   # importable, as a project's model.py is
    torch.manual_seed(0)
    eager = generated.build_model(cfg, shape, classes)
    compiled = copy.deepcopy(eager)
    x, y = batch(kind, shape, classes)
    statistics = {name: b.clone() for name, b in compiled.named_buffers()}
    rng = torch.get_rng_state()

    def warm_up(module):
        module.train()
        out = module(x)
        return nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())
    assert compile_model(compiled, warm_up, one_rank, is_root=True)
    assert all(p.grad is None for p in compiled.parameters())
    assert all(torch.equal(b, statistics[name]) for name, b in compiled.named_buffers())   # as it found it
    assert torch.equal(torch.get_rng_state(), rng)
    for _ in range(2):
        loss, grads = step(compiled, x, y)
        expected_loss, expected_grads = step(eager, x, y)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
        for got, expected in zip(grads, expected_grads):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for got, expected in zip(compiled.state_dict().values(), eager.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert list(compiled.state_dict()) == list(eager.state_dict())   # compiled in place: the same names


def test_a_model_that_does_not_compile_trains_eager_after_one_warning(capsys):
    def refuse(graph, example_inputs):
        raise RuntimeError("no compiler for this graph\nsecond line")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    eager = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    assert not compile_model(model, lambda m: nn.functional.cross_entropy(m(x), y), one_rank, is_root=True,
                             backend=refuse)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("warning: train.compile: torch.compile failed (")
    assert said[0].endswith("(RuntimeError: no compiler for this graph); training eager")
    torch.testing.assert_close(step(model, x, y)[0], step(eager, x, y)[0], rtol=0, atol=0)   # eager: the same bits
    assert not compile_model(copy.deepcopy(eager), lambda m: nn.functional.cross_entropy(m(x), y),
                             lambda problem: [None, "RuntimeError: rank 1's"], is_root=False)   # another rank's failure
    assert capsys.readouterr().out == ""   # rank 0 alone warns


def test_auto_compiles_on_gpus_only_and_a_pipeline_refuses_on():
    assert wanted("auto", torch.device("cuda", 0)) and not wanted("auto", torch.device("cpu"))
    assert wanted("on", torch.device("cpu")) and not wanted("off", torch.device("cuda", 0))
    assert not wanted("auto", torch.device("cuda", 0), pipeline=True)
    with pytest.raises(ConfigError, match="^train.compile on is for the data, model-split and tensor strategies"):
        wanted("on", torch.device("cpu"), pipeline=True)
