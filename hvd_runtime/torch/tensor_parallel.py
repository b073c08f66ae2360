"""Tensor parallelism (Megatron-LM's split linear layers) over a Horovod process set, for PyTorch.

    group = TensorGroup.of(layout, hvd.rank(), sets)      # this rank's tensor-parallel group
    up = ColumnParallelLinear(mlp.up, group)              # each rank: a slice of the output features
    down = RowParallelLinear(mlp.down, group)             # each rank: the matching input features

A pair of linear layers with an element-wise function between them splits so that no rank holds
either whole weight: the first is column-parallel (its output features sliced, so the element-wise
function runs on the rank's slice alone), the second row-parallel (the matching slice of its input
features; the partial products are summed over the group). Two collectives make the split exact,
Megatron's f and g, as autograd functions over Horovod's allreduce in the group's process set:

- f, before a column-parallel layer: identity forward; backward, the input's gradient summed over
  the group, since every rank's slice contributed to it;
- g, after a row-parallel layer: the partial outputs summed forward; identity backward.

The row-parallel bias is added after the sum, whole on every rank, and so gets the same gradient on
every rank, as does anything else left unsplit. The layers are built from the model's own
nn.Linear, so the model file never knows it was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hvd_runtime.parallel.tensor_groups import TensorLayout, TensorParallelError, split_range

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorGroup", "TensorParallelError"]


@dataclass(frozen=True)
class TensorGroup:
    """This rank's tensor-parallel group: its place in it, its size, and its Horovod process set."""

    rank: int
    size: int
    process_set: object

    @classmethod
    def of(cls, layout: TensorLayout, rank: int, process_sets: dict[tuple[int, ...], object]) -> "TensorGroup":
        """`process_sets`: the sets made at hvd.init for layout.process_set_ranks(), by their ranks."""
        from horovod.common.process_sets import global_process_set

        ranks = tuple(layout.tp_ranks(rank))
        return cls(layout.tp_rank(rank), layout.tp,
                   global_process_set if len(ranks) == layout.world else process_sets[ranks])


def _sum_over(tensor: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    import horovod.torch as hvd

    return hvd.allreduce(tensor.contiguous(), op=hvd.Sum, process_set=group.process_set)


class _CopyToGroup(torch.autograd.Function):
    """f: identity forward, gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _sum_over(grad, ctx.group), None


class _SumOverGroup(torch.autograd.Function):
    """g: partial results summed over the group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _sum_over(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """An nn.Linear whose output features are split: this rank computes its slice of them."""

    def __init__(self, linear: nn.Linear, group: TensorGroup):
        super().__init__()
        part = split_range(linear.out_features, group.size, group.rank, f"column-parallel {linear}")
        self.group = group
        self.in_features, self.out_features = linear.in_features, part.stop - part.start
        self.weight = nn.Parameter(linear.weight.detach()[part].clone())
        self.bias = nn.Parameter(linear.bias.detach()[part].clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToGroup.apply(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (of {self.out_features * self.group.size})"


class RowParallelLinear(nn.Module):
    """An nn.Linear whose input features are split: this rank multiplies its slice, the group sums."""

    def __init__(self, linear: nn.Linear, group: TensorGroup):
        super().__init__()
        part = split_range(linear.in_features, group.size, group.rank, f"row-parallel {linear}")
        self.group = group
        self.in_features, self.out_features = part.stop - part.start, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _SumOverGroup.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (of {self.in_features * self.group.size}), out_features={self.out_features}"
