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

`apply_tp(model, group)` splits the generated GPT's transformer blocks this way, as Megatron-LM
does: attention by heads (q, k and v column-parallel, the output projection row-parallel) and the
MLP column then row; embeddings, LayerNorms and the head stay whole. It reads the blocks' own
modules (`qkv`, `proj`, `mlp`, `norm1`, `norm2`, `heads`), so model.py is not edited.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hvd_runtime.parallel.tensor_groups import TensorGroup, TensorParallelError, check_block_splits, split_range

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorGroup", "TensorParallelBlock", "TensorParallelError",
           "apply_tp"]


def _sum_over(tensor: torch.Tensor, group: TensorGroup, name: str) -> torch.Tensor:
    """A named allreduce: the same names every step let Horovod's response cache skip negotiation."""
    import horovod.torch as hvd

    return hvd.allreduce(tensor.contiguous(), op=hvd.Sum, process_set=group.process_set, name=name)


class _CopyToGroup(torch.autograd.Function):
    """f: identity forward, gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _sum_over(grad, ctx.group, f"{ctx.name}.f"), None, None


class _SumOverGroup(torch.autograd.Function):
    """g: partial results summed over the group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        return _sum_over(x, group, f"{name}.g")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class ColumnParallelLinear(nn.Module):
    """An nn.Linear whose output features are split: this rank computes its slice of them.

    chunks: the output features are that many equal parts, each split over the group (a fused
    q, k, v projection: every rank takes its heads' rows of each). `source_index` lists the
    original rows this rank holds, in order.
    """

    def __init__(self, linear: nn.Linear, group: TensorGroup, chunks: int = 1, name: str = "tp.column"):
        super().__init__()
        self.name = name  # names this layer's allreduces: unique per layer
        if linear.out_features % chunks:
            raise TensorParallelError(f"{linear} does not divide into {chunks} equal chunks of output features")
        chunk = linear.out_features // chunks
        part = split_range(chunk, group.size, group.rank, f"column-parallel {linear}")
        self.source_index = torch.cat([torch.arange(c * chunk + part.start, c * chunk + part.stop)
                                       for c in range(chunks)])
        self.group = group
        self.in_features, self.out_features = linear.in_features, len(self.source_index)
        self.weight = nn.Parameter(linear.weight.detach()[self.source_index].clone())
        self.bias = nn.Parameter(linear.bias.detach()[self.source_index].clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToGroup.apply(x, self.group, self.name), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (of {self.out_features * self.group.size})"


class RowParallelLinear(nn.Module):
    """An nn.Linear whose input features are split: this rank multiplies its slice, the group sums."""

    def __init__(self, linear: nn.Linear, group: TensorGroup, name: str = "tp.row"):
        super().__init__()
        self.name = name  # names this layer's allreduces: unique per layer
        part = split_range(linear.in_features, group.size, group.rank, f"row-parallel {linear}")
        self.source_index = torch.arange(part.start, part.stop)  # the original input features (columns) held
        self.group = group
        self.in_features, self.out_features = part.stop - part.start, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _SumOverGroup.apply(F.linear(x, self.weight), self.group, self.name)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (of {self.in_features * self.group.size}), out_features={self.out_features}"


class TensorParallelBlock(nn.Module):
    """A pre-norm transformer block (the generated GPT's `Block`) with its heads and MLP split over the group."""

    def __init__(self, block: nn.Module, group: TensorGroup, name: str = "tp"):
        super().__init__()
        check_block_splits(block.heads, block.dropout, group.size)
        self.heads = block.heads // group.size
        # The block's own names, in its order: the split model's state_dict and parameter order
        # are the unsplit model's (hvd_runtime.torch.tensor_state relies on it for checkpoints).
        self.norm1 = block.norm1
        self.qkv = ColumnParallelLinear(block.qkv, group, chunks=3, name=f"{name}.qkv")
        self.proj = RowParallelLinear(block.proj, group, name=f"{name}.proj")
        self.norm2 = block.norm2
        self.mlp = nn.Sequential(ColumnParallelLinear(block.mlp[0], group, name=f"{name}.up"), block.mlp[1],
                                 RowParallelLinear(block.mlp[2], group, name=f"{name}.down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        local = self.qkv.out_features // 3
        q, k, v = self.qkv(self.norm1(x)).split(local, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, local // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, local))
        return x + self.mlp(self.norm2(x))


def _is_transformer_block(module: nn.Module) -> bool:
    mlp = getattr(module, "mlp", None)
    return (all(isinstance(getattr(module, name, None), nn.Linear) for name in ("qkv", "proj"))
            and isinstance(getattr(module, "heads", None), int) and isinstance(mlp, nn.Sequential)
            and len(mlp) >= 3 and isinstance(mlp[0], nn.Linear) and isinstance(mlp[2], nn.Linear))


def transformer_blocks(model: nn.Module) -> list[str]:
    """The names of the blocks apply_tp splits (attention with qkv and proj, an MLP of two linears)."""
    return [name for name, module in model.named_modules() if name and _is_transformer_block(module)]


def apply_tp(model: nn.Module, group: TensorGroup) -> nn.Module:
    """Split every transformer block of `model` over the group, in place; returns the model
    (unchanged for a group of one: tp 1 is the unsplit model)."""
    names = transformer_blocks(model)
    if not names:
        raise TensorParallelError(f"{type(model).__name__} has no transformer blocks to split (attention with "
                                  "qkv and proj, an MLP of two linears): tensor parallelism splits the gpt model; "
                                  "use --strategy data, model-split or pipeline for this one")
    if group.size == 1:
        return model
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, TensorParallelBlock(owner.get_submodule(child), group, name=f"tp.{name}"))
    return model
