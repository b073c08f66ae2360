"""Activation recomputation (`model.recompute: blocks`): each block keeps only its input for the
backward pass and runs its forward again there, trading one more forward for the activations
inside it.

The blocks are the model's (hvd_runtime.torch.stage.named_blocks: the children of its
nn.Sequential, or of a pipeline stage). Each block's class is swapped for a subclass whose forward
runs the original through `torch.utils.checkpoint` (non-reentrant), so state_dict names, copies of
the block, and strategies that swap layers inside it (tensor parallelism) are all unchanged; a
pipeline stage recomputes each micro-batch's blocks in that micro-batch's backward. The forward run
again is the same computation: dropout draws the same masks (checkpoint restores the RNG state),
and BatchNorm updates its running statistics once a step, not twice (it runs again with momentum
0). Outside training (evaluation, no_grad) a block runs as it is.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hvd_runtime.torch.stage import named_blocks

__all__ = ["is_recomputed", "recompute_blocks", "recomputation_off", "swap_class_beneath"]


def recompute_blocks(model: nn.Module) -> nn.Module:
    """Make every block of `model` recompute its activations in backward, in place; returns `model`."""
    for _, block in named_blocks(model):
        if not is_recomputed(block):
            block.__class__ = _recomputed_class(type(block))
    return model


class _Recomputed:
    """Marks a block whose forward is recomputed in backward."""


def is_recomputed(block: nn.Module) -> bool:
    return isinstance(block, _Recomputed)


@functools.cache
def _recomputed_class(cls: type) -> type:
    def forward(self, *args, **kwargs):
        inner = super(recomputed, self).forward
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=functools.partial(_contexts, self),
                          **kwargs)

    recomputed = type(cls.__name__, (_Recomputed, cls), {"forward": forward, "__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__})
    return recomputed


@contextlib.contextmanager
def recomputation_off(model: nn.Module):
    """Inside, every recomputed block of `model` runs as the class beneath its recomputation (what
    its recomputed forward runs in backward); yields those blocks."""
    swapped = [(block, type(block)) for _, block in named_blocks(model) if is_recomputed(block)]
    for block, cls in swapped:
        block.__class__ = cls.__bases__[1]
    try:
        yield [block for block, _ in swapped]
    finally:
        for block, cls in swapped:
            block.__class__ = cls


def swap_class_beneath(block: nn.Module, make_class) -> None:
    """Give `block` the class `make_class(its class)`, beneath recomputation where the block has it,
    so that a recomputed forward runs that class's forward again."""
    if is_recomputed(block):
        block.__class__ = _recomputed_class(make_class(type(block).__bases__[1]))
    else:
        block.__class__ = make_class(type(block))


def _contexts(block: nn.Module):
    """The forward as it is; the recomputation without a second BatchNorm statistics update."""
    return contextlib.nullcontext(), _StatisticsHeld(block)


class _StatisticsHeld:
    """BatchNorm layers of a block leave their running statistics as they are while inside. Entered
    again for each recomputation (a zero-bubble stage recomputes for each of its backward halves)."""

    def __init__(self, block: nn.Module):
        self.norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                      and m.track_running_stats]

    def __enter__(self):
        self.kept = [(m.momentum, m.num_batches_tracked.clone()) for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0   # running = (1 - 0) x running + 0 x batch: unchanged
        return self

    def __exit__(self, *exc):
        for m, (momentum, tracked) in zip(self.norms, self.kept):
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)
        return False
