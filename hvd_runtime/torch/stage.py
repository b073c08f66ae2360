"""Pipeline stages cut from an unchanged model: the model's own blocks, the others dropped.

The user's model is an `nn.Sequential` (or a list of blocks), each block passing one tensor to the
next. A stage is a new `nn.Sequential` holding the blocks of `[start, stop)` under their original
names, so its `state_dict()` keys are the model's own ("3.weight"), and the stages' state dicts
together are the model's. The blocks are shared, not copied: drop the model and the other
stages' blocks are freed.

    plan = plan_stages(model, stages=2, by="params")           # or by="time", sample=x
    stage = build_stage(model, place, partition=plan)         # place from init_pipeline, or an int

With chunks (interleaved schedules, `init_pipeline(..., chunks=v)`), the model is cut into p x v
pieces and a rank's stage holds pieces stage, stage + p, ...: still one module of the model's own
blocks under their own names, run a chunk at a time by `forward_chunk`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

from hvd_runtime.pipeline.partition import (Partition, PartitionError, plan_on_rank0, plan_partition,
                                            refuse_weights_shared_across_stages)
from hvd_runtime.torch.meta_init import is_meta, real_copy


def named_blocks(model) -> list[tuple[str, nn.Module]]:
    """(name, block) in order, from an nn.Sequential, nn.ModuleList, dict or list of modules."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return list(model.named_children())
    if isinstance(model, dict):
        return list(model.items())
    if isinstance(model, (list, tuple)) and all(isinstance(b, nn.Module) for b in model):
        return [(str(i), b) for i, b in enumerate(model)]
    raise PartitionError(f"cannot split a {type(model).__name__}: give an nn.Sequential or a list of blocks "
                         f"(e.g. nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))")


def param_costs(model) -> list[int]:
    """Parameters per block: balances memory, costs nothing to compute."""
    return [sum(p.numel() for p in block.parameters()) for _, block in named_blocks(model)]


def time_costs(model, sample: torch.Tensor, repeats: int = 3, tail=None) -> list[float]:
    """Seconds of forward + backward per block on `sample` (a batch like the training ones).

    Each block is timed alone on the activation it really receives; the fastest of `repeats`
    runs counts, since noise only ever adds time. `tail(output) -> loss` is what the last stage
    does beyond its blocks (the loss and the metrics): its forward and backward count to the last
    block, which always runs there. Left out, a time-balanced split gives the last stage more
    than its share, most on small blocks, where the loss costs as much as a layer. Blocks still on
    the meta device are timed on a real copy each, so the model is never whole on the timing rank.
    """
    costs, x = [], sample
    blocks = named_blocks(model)
    kept = [b.detach().clone() for _, block in blocks for b in block.buffers()]  # BatchNorm's statistics
    for _, block in blocks:
        if is_meta(block):   # a model built on the meta device: a real copy of one block at a time
            block = real_copy(block, seed=0, device=x.device)
        costs.append(_fastest_forward_backward(lambda inp: block(inp).float().sum(), x, repeats))
        block.zero_grad(set_to_none=True)
        with torch.no_grad():
            x = block(x)
    if tail is not None:
        costs[-1] += _fastest_forward_backward(tail, x, repeats)
    with torch.no_grad():   # timing trains nothing: the statistics it moved go back
        for b, before in zip((b for _, block in blocks for b in block.buffers()), kept):
            b.copy_(before)
    return costs


def _fastest_forward_backward(fn, x: torch.Tensor, repeats: int) -> float:
    """The fastest of `repeats` runs of fn(x) -> a scalar and its backward down to x (a block and
    its parameters, or the tail)."""
    best = float("inf")
    for _ in range(repeats):
        inp = x.detach().requires_grad_(x.is_floating_point())
        start = time.perf_counter()
        value = fn(inp)
        if value.requires_grad:
            value.backward()
        best = min(best, time.perf_counter() - start)
    return best


def plan_stages(model, stages: int, by: str | Sequence = "params", sample: torch.Tensor | None = None,
                tail=None) -> Partition:
    """Partition the model's blocks: by="params", by="time" (needs sample; `tail` as time_costs'),
    or stage starts (names/indices)."""
    names = [n for n, _ in named_blocks(model)]
    timing = (lambda: time_costs(model, sample, tail=tail)) if sample is not None else None
    plan = plan_partition(names, stages, by, lambda: param_costs(model), timing)
    refuse_weights_shared_across_stages(plan, [(name, block.parameters()) for name, block in named_blocks(model)])
    return plan


def plan_timed_on_rank0(model, stages: int, sample, tail, name: str) -> Partition:
    """plan_stages(by="time") for a job: rank 0 times the blocks, every rank cuts where it does
    (pipeline.partition.plan_on_rank0). `name` names the broadcast."""
    import horovod.torch as hvd

    return plan_on_rank0(lambda: plan_stages(model, stages, "time", sample, tail), hvd.rank(),
                         lambda planned: hvd.broadcast_object(planned, root_rank=0, name=name))


class Stage(nn.Sequential):
    """Blocks [start, stop) of the model, under their original names (with chunks, each chunk's)."""

    def __init__(self, blocks: "OrderedDict[str, nn.Module]", index: int, plan: Partition,
                 chunks: list[list[str]] | None = None):
        super().__init__(blocks)
        self.index = index
        self.plan = plan
        self.chunk_names = chunks or [list(blocks)]   # the block names of each chunk, in order

    def forward_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """Run one of the stage's chunks (the whole stage when it has one)."""
        for name in self.chunk_names[chunk]:
            x = self._modules[name](x)
        return x


def build_stage(model, place, partition: Partition | str | Sequence = "params",
                sample: torch.Tensor | None = None, tail=None) -> Stage:
    """This rank's stage of `model`. place: a PipelineRank (its stage and stage count) or a stage index.

    With an int, pass a Partition (or plan the stage count from it) so every stage agrees.
    partition="time" times the blocks on `sample`, and `tail` (time_costs') with the last.
    """
    if isinstance(place, int):
        if not isinstance(partition, Partition):
            raise PartitionError("build_stage(model, <stage index>) needs partition=plan_stages(model, stages)")
        index, stages, chunks = place, partition.stages, 1
    else:
        index, stages, chunks = place.stage, place.stages, place.chunks
    if not isinstance(place, int) and partition == "time":
        plan = plan_timed_on_rank0(model, stages * chunks, sample, tail, "pp.partition")
    else:
        plan = plan_stages(model, stages * chunks, partition, sample, tail)
    if plan.stages != stages * chunks:
        of = f"{stages} x {chunks} chunks" if chunks > 1 else f"{stages}"
        raise PartitionError(f"partition has {plan.stages} stages but the pipeline has {of}")
    blocks = named_blocks(model)
    kept: "OrderedDict[str, nn.Module]" = OrderedDict()
    chunk_names = []
    for piece in range(index, stages * chunks, stages):   # this rank's chunks: pieces index, index + p, ...
        start, stop = plan.bounds[piece]
        kept.update(blocks[start:stop])
        chunk_names.append([name for name, _ in blocks[start:stop]])
    return Stage(kept, index, plan, chunk_names)
