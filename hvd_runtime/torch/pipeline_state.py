"""The whole model of a pipeline job, on rank 0, where each rank holds only its stage.

A stage keeps its blocks' original names, so the union of the stages' state dicts is the unsplit
model's state dict: rank 0 loads it into the original model, to log or export one ordinary model.
Stages split by tensor parallelism (`split`, their SplitParameters) are gathered whole first.
This gathers the whole model on rank 0; checkpoints do not (hvd_runtime.torch.checkpoint).
"""

from __future__ import annotations

from torch import nn

from hvd_runtime.pipeline.checkpoint import gather_stages
from hvd_runtime.torch.buffers import average_buffers
from hvd_runtime.torch.meta_init import whole


def _to_cpu(state: dict) -> dict:
    return {k: v.detach().cpu() for k, v in state.items()}


def gather_full_model(model: nn.Module, stage: nn.Module, dims, split=None) -> nn.Module:
    """Every rank calls; returns, on rank 0, `model` (the unsplit original, made real if it was on
    the meta device) with the trained weights; on the other ranks `model` as it was.

    A stage's replicas first agree on its BatchNorm statistics (hvd_runtime.torch.buffers); a
    tensor-parallel stage's slices are gathered whole (`split`), the same on each rank of its group.
    """
    import horovod.torch as hvd

    if dims.dp_set is not None:
        average_buffers(stage, process_set=dims.dp_set, name="pp.checkpoint.buffers")
    weights = stage.state_dict() if split is None else split.full_model_state()
    stages, _ = gather_stages(hvd, dims, _to_cpu(weights), None, None)
    if hvd.rank() == 0:
        merged = {k: v for part in stages.values() for k, v in part["model"].items()}
        model = whole(model, seed=0)   # its values are the stages' next
        model.load_state_dict(merged)
    return model
