"""A stage's backward in two halves (zero-bubble schedules) gives exactly the gradients of one backward.

In one process, no Horovod: each model runs forward twice from the same weights, once backpropagated
whole and once as input half then weight half; the input's and every weight's gradients must agree
(1e-6, fp32), and the weights the second half was meant to take must still be untouched after the first.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvd_runtime.torch.split_backward import SplitBackward, WeightWork


class Block(nn.Module):
    """A residual block as ResNet writes it: BatchNorm, in-place ReLU, an in-place residual sum."""

    def __init__(self, width: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.BatchNorm1d(width)

    def forward(self, x):
        out = self.norm(self.fc(x))
        out += x
        return F.relu(out, inplace=True)


class TiedHead(nn.Module):
    """An embedding whose matrix the head reuses, functionally, outside the embedding's call."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.tokens, self.mix = nn.Embedding(vocab, width), nn.Linear(width, width)

    def forward(self, idx):
        return F.linear(torch.tanh(self.mix(self.tokens(idx))), self.tokens.weight)


class CalledTwice(nn.Module):
    """One Linear applied twice in a row (shared weights), beside a Linear used once."""

    def __init__(self, width: int):
        super().__init__()
        self.shared, self.once = nn.Linear(width, width), nn.Linear(width, width)
        self.scale = nn.Parameter(torch.ones(width))     # a weight of a module that has children

    def forward(self, x):
        return self.once(torch.tanh(self.shared(torch.tanh(self.shared(x))))) * self.scale


def mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


# (model, input, whether the stage has an input gradient to return, weights the second half must take)
CASES = {
    "mlp": (mlp, lambda: torch.randn(5, 6), True, "all"),
    "residual-batchnorm": (lambda: nn.Sequential(Block(6), Block(6)), lambda: torch.randn(5, 6), True, "all"),
    "tied-head": (lambda: TiedHead(11, 6), lambda: torch.randint(0, 11, (5, 4)), False, ["mix.weight", "mix.bias"]),
    "called-twice": (lambda: CalledTwice(6), lambda: torch.randn(5, 6), True, ["once.weight", "once.bias"]),
}


def grads_whole(model, x, upstream, needs_input):
    x = x.clone().requires_grad_(needs_input)
    out = model(x)
    out.backward(upstream)
    return (x.grad if needs_input else None), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_two_halves_give_the_gradients_of_one_backward(case):
    build, make_input, needs_input, put_off = CASES[case]
    torch.manual_seed(0)
    model = build()
    twin = build()
    twin.load_state_dict(model.state_dict())
    x = make_input()
    with torch.no_grad():
        upstream = torch.randn(model(x).shape)    # the gradient the next stage would send
    want_input, want = grads_whole(model, x, upstream, needs_input)

    halves = SplitBackward(twin)
    inp = x.clone().requires_grad_(needs_input)
    with halves.catching() as calls:
        out = twin(inp)
    input_grad, later = halves.input_half(out, upstream, inp if needs_input else None, calls)

    names = {id(p): n for n, p in twin.named_parameters()}
    deferred = sorted(names[id(p)] for part in later.parts for p in part.weights)
    expected = sorted(names.values()) if put_off == "all" else sorted(put_off)
    assert deferred == expected and halves.weights_put_off == len(expected)
    for name, p in twin.named_parameters():   # the first half left the put-off weights alone
        assert (p.grad is None) == (name in deferred), name
    if needs_input:
        torch.testing.assert_close(input_grad, want_input, rtol=1e-6, atol=1e-7)
    else:
        assert input_grad is None

    later.run()
    for name, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_second_micro_batch_adds_to_the_first():
    """Weight gradients accumulate over a step's micro-batches, whichever half computed them."""
    torch.manual_seed(0)
    model, twin = CalledTwice(6), CalledTwice(6)
    twin.load_state_dict(model.state_dict())
    xs, ups = [torch.randn(4, 6) for _ in range(2)], [torch.randn(4, 6) for _ in range(2)]
    for x, up in zip(xs, ups):
        model(x).backward(up)
    halves, work = SplitBackward(twin), []
    for x, up in zip(xs, ups):          # both input halves first, as a zero-bubble stage may do
        inp = x.clone().requires_grad_(True)
        with halves.catching() as calls:
            out = twin(inp)
        work.append(halves.input_half(out, up, inp, calls)[1])
    for w in work:
        w.run()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", ["mlp", "residual-batchnorm", "called-twice"])
def test_weight_halves_run_together_give_the_gradients_of_one_backward_per_micro_batch(case):
    """1f1b-batched-w: several micro-batches' weight halves at once, each plain Linear as one product
    over all their rows (added to gradients already there), the other modules one by one."""
    build, _, _, _ = CASES[case]
    torch.manual_seed(0)
    model, twin = build(), build()
    twin.load_state_dict(model.state_dict())
    for p, q in zip(model.parameters(), twin.parameters()):   # gradients already there are added to
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    xs = [torch.randn(n, 6) for n in (4, 3, 3)]               # uneven micro-batches
    ups = [torch.randn(n, 6 if case != "mlp" else 3) for n in (4, 3, 3)]
    if case == "residual-batchnorm":
        model.eval(), twin.eval()     # BatchNorm on its running statistics: each micro-batch alone is then exact
    for x, up in zip(xs, ups):
        model(x).backward(up)
    halves, works = SplitBackward(twin), []
    for x, up in zip(xs, ups):
        inp = x.clone().requires_grad_(True)
        with halves.catching() as calls:
            out = twin(inp)
        works.append(halves.input_half(out, up, inp, calls)[1])
    # a Linear whose output an in-place ReLU rewrote (the MLP's first) goes through autograd instead
    linears = sum(1 for part in works[0].parts if type(part.module) is nn.Linear and not part.changed)
    assert linears == {"mlp": 2, "residual-batchnorm": 2, "called-twice": 1}[case]
    assert WeightWork.run_together(works) == linears
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_weight_halves_that_do_not_line_up_run_one_by_one():
    """Micro-batches that deferred different module calls (another code path ran) are not batched."""
    torch.manual_seed(0)
    model = mlp()
    halves, works = SplitBackward(model), []
    for n in (4, 3):
        inp = torch.randn(n, 6, requires_grad=True)
        with halves.catching() as calls:
            out = model(inp)
        works.append(halves.input_half(out, torch.randn(n, 3), inp, calls)[1])
    works[1].parts.pop()
    assert WeightWork.run_together(works) == 0


def test_nothing_is_caught_outside_a_training_forward():
    model = mlp()
    halves = SplitBackward(model)
    model(torch.randn(2, 6))
    with halves.catching() as calls:
        model(torch.randn(2, 6))
    model(torch.randn(2, 6))
    assert [type(c.module).__name__ for c in calls] == ["Linear", "LayerNorm", "Linear", "Linear"]
