"""train.compile: the model's forward (and so its backward) compiled by torch.compile, or eager.

`auto` compiles on GPUs, where fewer, fused kernels shorten a step bound by kernel launches, and
stays eager on a CPU. The module's own forward is compiled in place (an attribute of the
instance: torch 2.13's `nn.Module.compile`, which compiles `_call_impl`, never reaches its
backend): its parameters, their names and the checkpoints keep what they were, its hooks run
as before, and Horovod's gradient hooks, which fire as each gradient is accumulated, stay
outside the graph.

The compilation is warmed up before training on one batch of the training set's shape, forward
and backward, the model's state kept as it was (its gradients cleared, BatchNorm's statistics and
the RNGs restored), so the first timed step is not the compilation. A compilation that fails falls
back to eager with one warning on rank 0, never a crash; the ranks agree, so all run alike.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from hvd_runtime.config import ConfigError

__all__ = ["compile_model", "wanted"]


def wanted(mode: str, device: torch.device, pipeline: bool = False, zero3: bool = False) -> bool:
    """Whether train.compile `mode` compiles on `device`; `on` with pipeline stages or ZeRO 3 (whose
    blocks gather their parameters as they run: collectives inside the graph) is refused."""
    if pipeline or zero3:
        if mode == "on":
            raise ConfigError("train.compile on is for the data, model-split and tensor strategies: a pipeline "
                              "stage runs eager; set train.compile auto or off" if pipeline else
                              "train.compile on does not work with horovod.zero 3 (its blocks gather their "
                              "parameters as they run): set train.compile auto or off, or horovod.zero 2")
        return False
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def _first_cause(exc: BaseException) -> str:
    """The exception at the root of `exc`'s chain (torch wraps a backend's own), in one line."""
    while (inner := getattr(exc, "inner_exception", None) or exc.__cause__) is not None:
        exc = inner
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def compile_model(model: nn.Module, warm_up: Callable[[nn.Module], torch.Tensor],
                  agree: Callable[[str | None], list], is_root: bool, backend: str | Callable = "inductor") -> bool:
    """Compile `model` in place and warm it up (`warm_up(model)`: a training step's loss, on a batch
    of the training set's shape); returns whether it runs compiled. Every rank calls: `agree(problem)`
    gathers each rank's failure (None where it compiled), one verdict for all."""
    started = time.perf_counter()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.forward = torch.compile(model.forward, backend=backend)   # an attribute of this instance only
    problem = None
    try:
        with torch.random.fork_rng(devices=_cuda_devices()):
            warm_up(model).backward()
    except Exception as exc:  # noqa: BLE001 - any failure to compile leaves the model eager
        problem = _first_cause(exc)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    failed = next((p for p in agree(problem) if p is not None), None)
    if failed is not None:
        del model.forward   # the class's forward again: eager
        if is_root:
            print(f"warning: train.compile: torch.compile failed ({failed[:200]}); training eager", flush=True)
        return False
    if is_root:
        print(f"train.compile: the model runs compiled (torch.compile, warmed up in "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
    return True
