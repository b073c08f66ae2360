"""Which parameters of a tensor-parallel model are split, and how: for checkpoints and clipping.

    slices = SlicedParameters(model)                      # after apply_tp
    slices.by_name["blocks.0.attn.qkv.weight"]            # Slicing(dim, whole positions held, group, whole size)

apply_tp keeps the whole model's parameter names and order, so the slices' names are the
whole model's: checkpoints (hvd_runtime.torch.checkpoint) write each slice under its name with
the positions it holds, and the whole model written from them (hvd_runtime.torch.whole_model)
loads into the plain `build_model`.
Checkpoints written before shards hold the unsplit state: local_model_state and
local_optimizer_state take this rank's slices of it (optimizer slots shaped like their parameter,
momentum and Adam's moments, sliced with it).

The gradient norm that clipping needs is the whole model's: the split parameters' squares are
summed over the group, the whole ones (LayerNorms, position embeddings, row-parallel biases)
counted once, so every rank of a group clips by the same factor and the whole ones stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hvd_runtime.parallel.tensor_groups import TensorGroup
from hvd_runtime.torch.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class Slicing:
    """How one parameter is split: along `dim`, this rank holding the original positions `index`
    of the whole tensor's `size` there (a vocabulary need not split evenly)."""

    dim: int
    index: torch.Tensor
    group: TensorGroup
    size: int


def _slicings(model: nn.Module) -> dict[str, Slicing]:
    slicings = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            slicings[prefix + "weight"] = Slicing(0, module.source_index, module.group, module.source_size)
            if getattr(module, "bias", None) is not None:
                slicings[prefix + "bias"] = Slicing(0, module.source_index, module.group, module.source_size)
        elif isinstance(module, RowParallelLinear):
            slicings[prefix + "weight"] = Slicing(1, module.source_index, module.group, module.source_size)
    return slicings


class SlicedParameters:
    """Which parameters apply_tp split and how; the checkpoint and clipping views built on that."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.by_name = _slicings(model)
        names = {id(p): name for name, p in model.named_parameters()}
        self.by_param = {pid: self.by_name[name] for pid, name in names.items() if name in self.by_name}

    def _params_in_order(self, optimizer) -> list[nn.Parameter]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def local_model_state(self, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.index_select(self.by_name[name].dim, self.by_name[name].index) if name in self.by_name else t
                for name, t in whole.items()}

    def saved_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes this model's state has in a checkpoint (the unsplit ones)."""
        shapes = {}
        for name, t in self.model.state_dict().items():
            shape = list(t.shape)
            if name in self.by_name:
                shape[self.by_name[name].dim] = self.by_name[name].size
            shapes[name] = tuple(shape)
        return shapes

    def _map_optimizer_state(self, optimizer, state_dict: dict, convert) -> dict:
        params = self._params_in_order(optimizer)
        moved = {}
        for index, entries in state_dict["state"].items():
            slicing = self.by_param.get(id(params[index]))
            moved[index] = {key: convert(value, slicing, f"optimizer.{index}.{key}") if slicing is not None
                            and isinstance(value, torch.Tensor) and value.dim() > 0 else value
                            for key, value in entries.items()}
        return {**state_dict, "state": moved}

    def local_optimizer_state(self, optimizer, whole: dict) -> dict:
        return self._map_optimizer_state(optimizer, whole, lambda t, s, _: t.index_select(s.dim, s.index))

    def grad_norm(self, parameters=None) -> torch.Tensor:
        """The whole model's gradient L2 norm, the same on every rank of a tensor-parallel group."""
        import horovod.torch as hvd

        sums = {True: [], False: []}  # split or whole: kept on the gradients' device, one copy to the host each
        for p in self.model.parameters():
            if p.grad is not None:
                sums[id(p) in self.by_param].append(p.grad.detach().float().pow(2).sum())
        split_sq, whole_sq = (torch.stack(s).sum().cpu() if s else torch.zeros(()) for s in (sums[True], sums[False]))
        groups = {id(s.group): s.group for s in self.by_param.values()}
        for group in groups.values():  # one group per model (apply_tp slicings over one)
            split_sq = hvd.allreduce(split_sq, op=hvd.Sum, process_set=group.process_set, name="tp.grad_norm")
        return (split_sq + whole_sq).sqrt()
