"""What a torch rank's share of the model and one step's activations will take (hvd_runtime.memory_plan),
measured on the meta device before anything is made real.

The activations are what autograd saves for backward in a forward of the rank's batch (a
pipeline stage: one micro-batch, times the micro-batches its schedule holds at once), counted per
block on meta tensors: shapes and dtypes, no values, no memory. A recomputed block keeps only its
input (what torch.utils.checkpoint saves), but its backward runs its forward again and holds what
that saves while it runs: the plan adds the largest such block once (one micro-batch's). Tensors
autograd saves that are parameters (a Linear's weight) are the parameters', counted once, there.
Under ZeRO 3 the plan also counts the largest block a rank gathers whole (MemoryPlan.gathered_bytes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from hvd_runtime.memory_plan import MemoryPlan, settle
from hvd_runtime.pipeline.schedule import theory_peak_in_flight
from hvd_runtime.torch.meta_init import is_meta
from hvd_runtime.torch.recompute import recomputation_off
from hvd_runtime.torch.stage import named_blocks

__all__ = ["BlockActivations", "activations_of", "block_activations", "held_parameters", "largest_block",
           "plan_and_check"]


def held_parameters(module: nn.Module) -> int:
    """Elements of `module`'s parameters, a tied one once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def largest_block(module: nn.Module) -> int:
    """Elements of the largest part of `module` that ZeRO 3 gathers whole at once (hvd_runtime.torch.zero):
    one of its blocks, or its own parameters outside them."""
    blocks = [block for _, block in named_blocks(module)]
    inside = {id(p) for block in blocks for p in block.parameters()}
    own = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values() if id(p) not in inside)
    return max([held_parameters(block) for block in blocks] + [own])


def block_activations(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes autograd keeps in each block of the meta `model` for a forward of a batch shaped as `x`."""
    params = {id(p) for p in model.parameters()}
    current: list[str | None] = [None]
    saved: Counter = Counter()

    def entering(name):
        def hook(block, args):
            current[0] = name
        return hook

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if current[0] is not None and id(base) not in params and id(t) not in params:
            saved[current[0]] += t.numel() * t.element_size()
        return t

    hooks = [block.register_forward_pre_hook(entering(name)) for name, block in named_blocks(model)]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.empty(x.shape, dtype=x.dtype, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    return dict(saved)


@dataclass(frozen=True)
class BlockActivations:
    """Bytes by block name: what each block keeps for backward (`kept`), and what each recomputed
    block's forward saves again while its backward runs (`recomputing`)."""

    kept: dict[str, int]
    recomputing: dict[str, int]

    def bytes(self, blocks: list[str] | None, scale: float, recompute_scale: float) -> int:
        """The peak of `blocks` (all by default): what they keep, times `scale`, and the largest
        recomputation once, times `recompute_scale`."""
        def of(counts: dict[str, int]) -> list[int]:
            return [v for name, v in counts.items() if blocks is None or name in blocks]

        return round(scale * sum(of(self.kept)) + recompute_scale * max(of(self.recomputing), default=0))


def activations_of(model: nn.Module, sample: torch.Tensor) -> BlockActivations | None:
    """block_activations of a meta model, and its recomputed blocks' without recomputation; None for
    a model made real (measuring it would compute) or one with an op that has no meta kernel."""
    if not is_meta(model):
        return None
    try:
        kept = block_activations(model, sample)
        with recomputation_off(model) as recomputed:
            whole = block_activations(model, sample) if recomputed else {}
    except Exception:  # noqa: BLE001 - the plan then goes without activations
        return None
    names = {id(block): name for name, block in named_blocks(model)}
    return BlockActivations(kept, {names[id(block)]: whole.get(names[id(block)], 0) for block in recomputed})


def plan_and_check(module: nn.Module, per_block: BlockActivations | None, ctx, cfg, splits: str,
                   blocks: list[str] | None = None, scale: float = 1.0, recompute_scale: float | None = None,
                   meta: bool | None = None) -> MemoryPlan | None:
    """The plan for `module`, this rank's share on the meta device, printed by rank 0; refuses
    (ConfigError) what this host cannot hold. Its activations: `per_block`'s of `blocks` (all by
    default), times `scale` (the micro-batches a stage holds at once; 1/tp of a split block's), and
    the largest recomputation once, times `recompute_scale` (`scale` by default; a stage's is one
    micro-batch's).
    Every rank plans or none does (the verdict is a collective): `meta`, whether the whole model is
    still on the meta device, decides for a stage, which may hold no parameter at all."""
    if not (is_meta(module) if meta is None else meta):
        return None   # made real already: nothing left to plan
    activations = None if per_block is None else \
        per_block.bytes(blocks, scale, scale if recompute_scale is None else recompute_scale)
    largest = largest_block(module) if cfg.horovod.zero >= 3 else 0
    return settle(held_parameters(module), activations, ctx, cfg, splits, largest_block=largest)


def pipeline_in_flight(cfg, place) -> float:
    """Micro-batches of this stage's activations held at once (a chunk's a 1/chunks part of them)."""
    return theory_peak_in_flight(cfg.parallel.schedule, place.stages, cfg.parallel.micro_batches, place.stage,
                                 place.chunks) / place.chunks
