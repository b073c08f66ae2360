"""model-split: one worker's model cut into stages on its own devices; Horovod data parallel across workers.

    model = ModelSplit(model, stages=2, micro_batches=4)    # this rank's share of the GPUs, or the CPU
    optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    out = model(x); loss = loss_fn(out, y.to(model.output_device))

Activations move from device to device between stages. With micro_batches > 1 the batch is cut
into chunks issued as a wavefront (stage s works on chunk i while stage s+1 works on chunk i-1);
CUDA runs kernels asynchronously, so on GPUs the stages overlap. On CPU the result is the same,
only without overlap. The output is the whole batch's, so the loss and the gradients are exactly
those of the whole model (BatchNorm aside: it sees one chunk at a time).

Its state_dict() is the whole model's, under the model's own keys ("2.0.weight", not
"stages.1.2.0.weight"): a checkpoint does not depend on where the stages cut (`partition: time`
may cut elsewhere at the next start) and loads into the plain model too.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from hvd_runtime.devices import local_rank_and_size, stage_gpus
from hvd_runtime.pipeline.partition import Partition
from hvd_runtime.torch.stage import build_stage, plan_stages


def split_devices(stages: int, local_rank: int = 0, local_size: int = 1) -> list[torch.device]:
    """Devices for this worker's stages: its own share of the host's GPUs, or the CPU for all.

    Worker k of local_size on a host takes GPUs k*stages .. k*stages+stages-1; with no GPU every
    stage is on the CPU; with too few GPUs (hvd_runtime.devices) a TooFewGpus config error.
    """
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = stage_gpus(stages, local_rank, local_size, visible)
    if gpus is None:
        return [torch.device("cpu")] * stages
    return [torch.device("cuda", g) for g in gpus]


class ModelSplit(nn.Module):
    """The model's blocks in `stages` groups, each on its device; forward moves activations along."""

    def __init__(self, model, stages: int = 2, devices: Sequence | None = None,
                 partition: Partition | str | Sequence = "params", micro_batches: int = 1,
                 sample: torch.Tensor | None = None, tail=None):
        super().__init__()
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        plan = plan_stages(model, stages, partition, sample, tail)
        if devices is None:
            devices = split_devices(stages, *local_rank_and_size("horovod.torch"))
        devices = [torch.device(d) for d in devices]
        if len(devices) != stages:
            raise ValueError(f"got {len(devices)} devices for {stages} stages: give one device per stage")
        self.plan, self.devices, self.micro_batches = plan, devices, micro_batches
        self.stages = nn.ModuleList(build_stage(model, k, plan).to(d) for k, d in enumerate(devices))
        self._stage_of = {name: k for k in range(plan.stages) for name in plan.stage_names(k)}
        self.register_state_dict_post_hook(_model_keys)
        self.register_load_state_dict_pre_hook(_split_keys)

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = list(x.tensor_split(min(self.micro_batches, len(x))))
        p, m = len(self.stages), len(chunks)
        # wavefront: at tick t, stage s runs chunk t - s; later stages first so their inputs are ready
        for t in range(m + p - 1):
            for s in reversed(range(p)):
                i = t - s
                if 0 <= i < m:
                    chunks[i] = self.stages[s](chunks[i].to(self.devices[s], non_blocking=True))
        return torch.cat(chunks) if m > 1 else chunks[0]


def _model_keys(split: ModelSplit, state: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: "stages.1.2.0.weight" becomes the model's own "2.0.weight"."""
    for key in [k for k in state if k.startswith(prefix + "stages.")]:
        _, rest = key[len(prefix) + len("stages."):].split(".", 1)   # the stage index, then the model's key
        state[prefix + rest] = state.pop(key)


def _split_keys(split: ModelSplit, state: dict, prefix: str, *_) -> None:
    """load_state_dict hook: the model's own keys go to the stage that holds their block now."""
    for key in [k for k in state if k.startswith(prefix)]:
        rest = key[len(prefix):]
        block = rest.split(".", 1)[0]
        if block in split._stage_of:
            state[f"{prefix}stages.{split._stage_of[block]}.{rest}"] = state.pop(key)
