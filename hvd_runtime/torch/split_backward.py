"""A stage's backward in two halves, for zero-bubble schedules: input gradient now, weight gradients later.

The previous stage waits only for the gradient of this stage's input. Autograd computes just the
gradients it is asked for (a Linear's node skips its weight's matrix product when only its
input's gradient is wanted), so the first half asks for the input and for the outputs of the
stage's weight-holding leaf modules (Linear, Conv, norms, embeddings), caught by forward hooks.
The second half starts from each such output with the gradient the first half found for it and
asks only for that module's own weights: the module's few nodes run again, the chain through
the rest of the stage does not.

Several micro-batches' second halves may run together (`WeightWork.run_together`): a plain
`nn.Linear`'s weight gradient is then one product over all their rows, G^T X, added straight into
`.grad`, instead of one thin product per micro-batch, each writing a weight-sized result that is
then added again. Any other module runs its micro-batches one after another, as before.

That is exact only if a weight is used nowhere but inside its module's one call. A weight tied
elsewhere (a head reusing the embedding's matrix), a module called twice, or a module whose
output is not one tensor keeps its weights in the first half, which then differentiates them
directly. The check walks the micro-batch's graph: every edge into a weight's gradient
accumulator must lie between its module's output and its inputs.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class _Call:
    module: torch.nn.Module
    inputs: tuple
    output: object
    version: int = 0   # the output's version counter when the module returned it (in-place ops raise it)


@dataclass
class WeightPart:
    """One module call's weight half: its output, the output's gradient, the weights, and its input.

    `changed`: an in-place op (a ReLU(inplace=True)) rewrote the output after the module returned
    it, so the gradient found for it is the gradient after that op, and only autograd, going back
    through it, gets the module's own.
    """

    output: torch.Tensor
    grad: torch.Tensor
    weights: list[torch.nn.Parameter]
    module: torch.nn.Module
    input: object
    changed: bool = False

    def run(self) -> None:
        torch.autograd.backward(self.output, self.grad, inputs=self.weights)   # adds into each weight's .grad


@dataclass
class WeightWork:
    """What the second half needs for one micro-batch: a part per module call whose weights wait."""

    parts: list[WeightPart]

    def run(self) -> None:
        for part in self.parts:
            part.run()

    @staticmethod
    def run_together(works: list["WeightWork"]) -> int:
        """Several micro-batches' second halves: each Linear's once over all their rows, the rest in turn.

        The parts line up when every micro-batch deferred the same module calls in the same order
        (one stage, one chunk: the same code ran); otherwise each micro-batch runs alone. Returns
        how many Linear calls went as one product.
        """
        lined_up = all(len(w.parts) == len(works[0].parts) and
                       all(a.module is b.module for a, b in zip(w.parts, works[0].parts)) for w in works)
        if not lined_up:
            for work in works:
                work.run()
            return 0
        batched = 0
        for parts in zip(*(w.parts for w in works)):
            if _batchable_linear(parts):
                _linear_weight_grads(parts)
                batched += 1
            else:
                for part in parts:
                    part.run()
        return batched


def _batchable_linear(parts: tuple[WeightPart, ...]) -> bool:
    """Plain nn.Linear calls, outputs untouched since, whose input, output gradient and weight share
    one dtype (no autocast)."""
    module = parts[0].module
    if type(module).forward is not torch.nn.Linear.forward or len(parts) < 2:
        return False
    weights = [id(w) for w in parts[0].weights]
    return all(not p.changed and [id(w) for w in p.weights] == weights and isinstance(p.input, torch.Tensor)
               and p.input.dtype == p.grad.dtype == module.weight.dtype for p in parts)


def _accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad.add_(grad)


def _linear_weight_grads(parts: tuple[WeightPart, ...]) -> None:
    """dW += G^T X and db += sum(G) over every micro-batch's rows: one product for the lot."""
    module = parts[0].module
    rows = torch.cat([p.input.detach().reshape(-1, p.input.shape[-1]) for p in parts])
    grads = torch.cat([p.grad.reshape(-1, p.grad.shape[-1]) for p in parts])
    wanted = {id(w) for w in parts[0].weights}
    if id(module.weight) in wanted:
        if module.weight.grad is None:
            module.weight.grad = grads.t() @ rows
        else:
            module.weight.grad.addmm_(grads.t(), rows)
    if module.bias is not None and id(module.bias) in wanted:
        _accumulate(module.bias, grads.sum(0))


class SplitBackward:
    """Catches a stage's weight-holding module calls during a training forward, then splits its backward."""

    def __init__(self, stage: torch.nn.Module):
        self._owners = {}
        for module in stage.modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if own and next(module.children(), None) is None:
                self._owners[module] = own
                module.register_forward_hook(self._caught)
        self._params = [p for p in stage.parameters() if p.requires_grad]
        self._calls: list[_Call] | None = None
        self.weights_put_off = 0   # of the stage's weights, how many the last micro-batch left to the second half

    def _caught(self, module, inputs, output) -> None:
        if self._calls is not None:
            self._calls.append(_Call(module, inputs, output, getattr(output, "_version", 0)))

    @contextmanager
    def catching(self):
        """Record the weight-holding module calls of the forward run inside; yields their list."""
        self._calls = calls = []
        try:
            yield calls
        finally:
            self._calls = None

    def input_half(self, target: torch.Tensor, grad, inp: torch.Tensor | None,
                   calls: list[_Call]) -> tuple[torch.Tensor | None, WeightWork]:
        """Backpropagate `target` (with `grad`) to `inp`; weights that cannot wait get their gradients now.

        Returns the input's gradient (None when `inp` is None: the first stage) and the rest of the work.
        """
        deferred = self._deferred(target, calls)
        later = {id(p) for _, weights in deferred for p in weights}
        self.weights_put_off = len(later)
        now = [p for p in self._params if id(p) not in later]
        sources = ([inp] if inp is not None else []) + now + [call.output for call, _ in deferred]
        if not sources:
            return None, WeightWork([])
        grads = torch.autograd.grad(target, sources, grad, retain_graph=bool(deferred), allow_unused=True)
        input_grad = grads[0] if inp is not None else None
        rest = grads[1 if inp is not None else 0:]
        for p, g in zip(now, rest[:len(now)]):
            if g is not None:
                _accumulate(p, g)
        parts = [WeightPart(call.output, g, weights, call.module, call.inputs[0] if call.inputs else None,
                            changed=call.output._version != call.version)
                 for (call, weights), g in zip(deferred, rest[len(now):]) if g is not None]
        return input_grad, WeightWork(parts)

    def _deferred(self, target: torch.Tensor, calls: list[_Call]) -> list[tuple[_Call, list]]:
        """The module calls whose weights' gradients can wait, with those weights."""
        once = Counter(call.module for call in calls)
        uses = _weight_uses(target.grad_fn, None)
        deferred = []
        for call in calls:
            out = call.output
            if once[call.module] != 1 or not isinstance(out, torch.Tensor) or out.grad_fn is None:
                continue
            stops = {t.grad_fn for t in call.inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
            inside = _weight_uses(out.grad_fn, stops)
            weights = [p for p in self._owners[call.module] if uses[id(p)] and inside[id(p)] == uses[id(p)]]
            if weights:
                deferred.append((call, weights))
        return deferred


def _weight_uses(root, stops: set | None) -> Counter:
    """Edges into each parameter's gradient accumulator reachable from `root`, not going past `stops`."""
    counts: Counter = Counter()
    seen, todo = {root}, [root]
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is not None:
                counts[id(variable)] += 1
            elif nxt not in seen and (stops is None or nxt not in stops):
                seen.add(nxt)
                todo.append(nxt)
    return counts
