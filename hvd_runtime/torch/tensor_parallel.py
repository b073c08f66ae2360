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

`apply_tp(model, group)` splits the generated GPT this way, as Megatron-LM does, by swapping
layers (torchtitan's plan style): in each transformer block the linear layers BLOCK_PLAN names are
replaced by column- and row-parallel ones (attention by heads: q, k and v column-parallel, the
output projection row-parallel; the MLP column then row), the block's `heads` becomes this rank's
share, and the block's own forward runs on them, so an edited `Block.forward` is still the model
that trains. The token embedding and the head split by vocabulary rows. Each rank looks up
only the tokens in its rows (the others read zeros) and the group sums the lookups; the head is
column-parallel over the vocabulary and its logits stay split, which the loss and accuracy of
`hvd_runtime.torch.vocab_parallel` read without ever gathering them (the largest activation of a
language model: batch x tokens x vocabulary). A head tied to the embedding stays tied: both hold
the same rows. Position embeddings and LayerNorms stay whole. A model built on the meta device
(hvd_runtime.torch.meta_init) splits into meta slices that know which rows and columns of the whole
tensors they hold: materialized, each rank draws only its own. It finds the model's modules by
what they are (a block: a module holding the plan's linear layers and a `heads` count; the token
embedding: a `tokens` nn.Embedding; the head: an `out` nn.Linear beside a `norm`), so model.py is
not edited; a block whose heads do not split is refused in one line.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hvd_runtime.parallel.tensor_groups import (TensorGroup, TensorParallelError, check_block_splits, check_no_dropout,
                                                slice_range, vocab_range)
from hvd_runtime.torch.meta_init import take

__all__ = ["BLOCK_PLAN", "ColumnParallelLinear", "Columnwise", "RowParallelLinear", "Rowwise", "TensorGroup",
           "TensorParallelError", "VocabParallelEmbedding", "apply_tp", "slice_model", "transformer_blocks"]


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


def sum_over_group(x: torch.Tensor, group: TensorGroup, name: str) -> torch.Tensor:
    """Megatron's g as a function: `x` summed over the group forward, the gradient passed on as it is."""
    return _SumOverGroup.apply(x, group, name)


class ColumnParallelLinear(nn.Module):
    """An nn.Linear whose output features are split: this rank computes its slice of them.

    chunks: the output features are that many equal parts, each split over the group (a fused
    q, k, v projection: every rank takes its heads' rows of each). `part`: the rows this rank holds
    when they are not an equal share (a head's vocabulary). `source_index` lists the original rows
    this rank holds, in order.
    """

    def __init__(self, linear: nn.Linear, group: TensorGroup, chunks: int = 1, name: str = "tp.column",
                 part: slice | None = None):
        super().__init__()
        self.name = name  # names this layer's allreduces: unique per layer
        if linear.out_features % chunks:
            raise TensorParallelError(f"{linear} does not divide into {chunks} equal chunks of output features")
        chunk = linear.out_features // chunks
        part = part or slice_range(chunk, group.size, group.rank, f"column-parallel {linear}")
        self.source_index = torch.cat([torch.arange(c * chunk + part.start, c * chunk + part.stop)
                                       for c in range(chunks)])
        self.group = group
        self.in_features, self.out_features = linear.in_features, len(self.source_index)
        self.source_size = linear.out_features   # the whole layer's rows
        self.weight = take(linear.weight, rows=self.source_index)
        self.bias = take(linear.bias, rows=self.source_index) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToGroup.apply(x, self.group, self.name), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (split over tp {self.group.size})"


class RowParallelLinear(nn.Module):
    """An nn.Linear whose input features are split: this rank multiplies its slice, the group sums."""

    def __init__(self, linear: nn.Linear, group: TensorGroup, name: str = "tp.row"):
        super().__init__()
        self.name = name  # names this layer's allreduces: unique per layer
        part = slice_range(linear.in_features, group.size, group.rank, f"row-parallel {linear}")
        self.source_index = torch.arange(part.start, part.stop)  # the original input features (columns) held
        self.source_size = linear.in_features   # the whole layer's columns
        self.group = group
        self.in_features, self.out_features = part.stop - part.start, linear.out_features
        self.weight = take(linear.weight, cols=part)
        self.bias = take(linear.bias) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = sum_over_group(F.linear(x, self.weight), self.group, self.name)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (of {self.in_features * self.group.size}), out_features={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """An nn.Embedding whose rows (token ids) are split: this rank looks up its own, the group sums.

    A token outside this rank's rows reads zeros here and its embedding from the rank holding it,
    so the sum is the whole lookup; backward, each rank's rows get only their tokens' gradients.
    """

    def __init__(self, embedding: nn.Embedding, group: TensorGroup, name: str = "tp.embedding"):
        super().__init__()
        self.name, self.group = name, group
        part = vocab_range(embedding.num_embeddings, group.size, group.rank)
        self.start, self.stop = part.start, part.stop
        self.source_index = torch.arange(part.start, part.stop)  # the original rows (token ids) held
        self.source_size = embedding.num_embeddings   # the whole vocabulary
        self.weight = take(embedding.weight, rows=part)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.stop)
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return sum_over_group(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group, self.name)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.stop - 1}, width {self.weight.shape[1]} (split over tp {self.group.size})"


@dataclass(frozen=True)
class Columnwise:
    """A plan entry: the layer's output features split (`chunks` equal parts, each split: a fused q, k, v)."""

    chunks: int = 1

    def swap(self, linear: nn.Linear, group: TensorGroup, name: str) -> nn.Module:
        return ColumnParallelLinear(linear, group, chunks=self.chunks, name=name)


@dataclass(frozen=True)
class Rowwise:
    """A plan entry: the layer's input features split, the partial products summed over the group."""

    def swap(self, linear: nn.Linear, group: TensorGroup, name: str) -> nn.Module:
        return RowParallelLinear(linear, group, name=name)


# How a transformer block splits, torchtitan's plan style: each of its linear layers by its name in
# the block. Attention by heads (q, k and v column-parallel, the output projection row-parallel),
# the MLP column then row. The block's own forward runs on the swapped layers, its `heads` set to
# this rank's share of them.
BLOCK_PLAN = {"qkv": Columnwise(chunks=3), "proj": Rowwise(), "mlp.0": Columnwise(), "mlp.2": Rowwise()}


def _linear_at(block: nn.Module, path: str) -> nn.Linear | None:
    try:
        module = block.get_submodule(path)
    except AttributeError:
        return None
    return module if isinstance(module, nn.Linear) else None


def _is_transformer_block(module: nn.Module) -> bool:
    return all(_linear_at(module, path) is not None for path in BLOCK_PLAN)


def transformer_blocks(model: nn.Module) -> list[str]:
    """The names of the blocks apply_tp splits: modules holding every linear layer BLOCK_PLAN names."""
    return [name for name, module in model.named_modules() if name and _is_transformer_block(module)]


def _dropout_of(block: nn.Module) -> float:
    """The block's largest dropout: its `dropout` attribute (a number) and its nn.Dropout layers'."""
    rate = getattr(block, "dropout", None)
    rates = [m.p for m in block.modules() if isinstance(m, nn.Dropout)]
    return max([*rates, float(rate)] if isinstance(rate, (int, float)) else rates, default=0.0)


def _check_heads(name: str, block: nn.Module, tp: int) -> int:
    """The block's head count (its `heads`), checked against its q, k, v layer and tp: one line if off."""
    heads = getattr(block, "heads", None)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise TensorParallelError(f"model.py's block `{name}` has no head count: tensor parallelism splits "
                                  "attention by heads and reads them from the block's `heads` (an int); "
                                  "keep `self.heads` in Block")
    features = block.get_submodule("qkv").out_features
    if features % (3 * heads):
        raise TensorParallelError(f"model.py's block `{name}`: its qkv layer's {features} features are not 3 x "
                                  f"{heads} heads of one width: make qkv 3 x width and width a multiple of heads")
    check_block_splits(heads, _dropout_of(block), tp)
    return heads


class _Owner:
    """Swaps a module's children in shallow copies of it and of every module above it, so a model
    that shares modules with another (a pipeline stage with the whole model) changes alone."""

    def __init__(self, model: nn.Module):
        self.model, self.copies = model, set()

    def own(self, name: str) -> nn.Module:
        """The submodule `name`, made this model's own (copied once, with its own table of children)."""
        module = self.model
        for child in name.split(".") if name else []:
            below = module._modules[child]
            if id(below) not in self.copies:
                below = copy.copy(below)
                below._modules = dict(below._modules)
                self.copies.add(id(below))
                module._modules[child] = below
            module = below
        return module

    def swap(self, name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.own(parent), child, module)


def _holder(model: nn.Module, attribute: str, kind: type, beside: str | None = None):
    """The first (name, module) whose `attribute` is a `kind` (and that also has `beside`), or None."""
    return next(((name, module) for name, module in model.named_modules()
                 if isinstance(getattr(module, attribute, None), kind) and (beside is None or hasattr(module, beside))),
                None)


def _join(owner: str, child: str) -> str:
    return f"{owner}.{child}" if owner else child


def slice_model(model: nn.Module, group: TensorGroup) -> nn.Module:
    """Split whatever `model` holds of the GPT over the group, in place, and return it: each
    transformer block's linear layers swapped as BLOCK_PLAN says and its `heads` set to this rank's
    share, the token embedding (the `tokens` nn.Embedding of a module) and the head (the `out`
    nn.Linear of a module with a `norm`) by vocabulary rows. Every module keeps its name, so the
    split model's state_dict names are the whole model's. A pipeline stage may hold any of them,
    or none; the modules it shares with the whole model are copied before they change."""
    owner = _Owner(model)
    for name in transformer_blocks(model):
        heads = _check_heads(name, model.get_submodule(name), group.size)
        block = owner.own(name)
        for path, style in BLOCK_PLAN.items():
            owner.swap(_join(name, path), style.swap(block.get_submodule(path), group, f"tp.{_join(name, path)}"))
        block.heads = heads // group.size
    split_tokens, tokens = None, _holder(model, "tokens", nn.Embedding)
    if tokens is not None:
        owner_name, embedding = tokens[0], tokens[1].tokens
        dropout = getattr(tokens[1], "dropout", None)
        check_no_dropout(dropout.p if isinstance(dropout, nn.Dropout) else 0.0)
        split_tokens = VocabParallelEmbedding(embedding, group, name=f"tp.{_join(owner_name, 'tokens')}")
        owner.swap(_join(owner_name, "tokens"), split_tokens)
    head = _holder(model, "out", nn.Linear, beside="norm")
    if head is not None:
        owner_name, out = head[0], head[1].out
        rows = vocab_range(out.out_features, group.size, group.rank)
        split_out = ColumnParallelLinear(out, group, name=f"tp.{_join(owner_name, 'out')}", part=rows)
        if tokens is not None and out.weight is embedding.weight:  # tied: one parameter, the same rows
            split_out.weight = split_tokens.weight
        owner.swap(_join(owner_name, "out"), split_out)
    return model


def apply_tp(model: nn.Module, group: TensorGroup) -> nn.Module:
    """Split `model` over the group, in place (slice_model); returns the model (unchanged for a group
    of one: tp 1 is the whole model). Its logits are then split over the vocabulary:
    train with hvd_runtime.torch.vocab_parallel's loss and accuracy."""
    if not transformer_blocks(model):
        raise TensorParallelError(f"{type(model).__name__} has no transformer blocks to split (linear layers "
                                  f"{', '.join(BLOCK_PLAN)}): tensor parallelism splits the gpt model; "
                                  "use --strategy data, model-split or pipeline for this one")
    return model if group.size == 1 else slice_model(model, group)
