"""Mixed precision under Horovod: autocast for the forward pass, loss scaling for fp16, clipping,
and the check that skips or stops at a non-finite update (hvd_runtime.nonfinite).

bf16 keeps fp32's exponent range, so it needs no loss scaling: autocast alone, on CPU or GPU.
fp16 does: the loss is scaled up before backward so small gradients survive, and unscaled before
the update. Under Horovod the order matters: wait for the allreduced gradients (synchronize),
unscale them, clip them by their global norm, then step *without* a second synchronize. Every
rank then unscales the same averaged gradients, so every rank skips the same overflowed steps.
The finiteness check reads the same averaged gradients' norm, so every rank decides alike too.
"""

from __future__ import annotations

import contextlib

import torch

from hvd_runtime.config import ConfigError
from hvd_runtime.nonfinite import Guard

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device: torch.device, clip_norm: float = 0.0, grad_norm=None):
        """grad_norm(parameters): the global gradient norm, where the parameters alone do not give
        it (a tensor-parallel model: hvd_runtime.torch.tensor_state.SlicedParameters.grad_norm)."""
        if name not in DTYPES:
            raise ConfigError(f"train.precision is {name!r}: choose one of {', '.join(DTYPES)}")
        if name == "fp16" and torch.device(device).type != "cuda":
            raise ConfigError("train.precision fp16 needs a GPU (its loss scaling is CUDA's): "
                              "use bf16 on the CPU, or fp32")
        self.name, self.device, self.clip_norm, self.grad_norm = name, torch.device(device), clip_norm, grad_norm
        self.dtype = DTYPES[name]
        self.scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None

    def autocast(self):
        """Forward pass and loss in the low-precision dtype where it is safe; a no-op for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, guard: Guard | None = None) -> None:
        """Backward of `loss`; under a guard, a non-finite loss makes every gradient NaN."""
        if self.checks(guard):
            loss = poisoned(loss)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def checks(self, guard: Guard | None) -> bool:
        """Whether `guard` checks the updates (under fp16 the loss scaler skips overflows itself)."""
        return guard is not None and guard.checks and self.scaler is None

    def step(self, optimizer, parameters, guard: Guard | None = None, step: int = 0) -> bool:
        """Apply the averaged gradients (optimizer: Horovod's DistributedOptimizer, or ZeRO's) unless
        `guard` finds them not finite at update `step`; whether they were applied. `parameters`: the
        tensors the optimizer steps (ZeRO: this rank's rows), whose gradients are clipped."""
        checking = self.checks(guard)
        if self.scaler is None and not self.clip_norm and not checking:
            optimizer.step()  # Horovod: waits for the allreduced gradients, then applies them
            return True
        distributed = hasattr(optimizer, "synchronize")  # a lone tensor-parallel replica steps unwrapped
        if distributed:
            optimizer.synchronize()  # Horovod: the averaged gradients, before touching them
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            if hasattr(optimizer, "agree_on_overflow"):   # ZeRO: each rank unscaled only its rows
                optimizer.agree_on_overflow(self.scaler)
        if self.clip_norm or checking:
            parameters = list(parameters)
            norm = (torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
                    if self.grad_norm is None else self.grad_norm(parameters))
            # the same averaged gradients on every rank of the set: every rank decides alike
            if checking and not guard.allows(bool(torch.isfinite(norm)), step):
                return False
            if self.clip_norm:
                torch.nn.utils.clip_grads_with_norm_(parameters, self.clip_norm, norm)
        # Horovod: already synchronized above
        with optimizer.skip_synchronize() if distributed else contextlib.nullcontext():
            if self.scaler is not None:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()
        return True


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, times 1 where it is finite and NaN where not: a non-finite loss's gradients are all NaN."""
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
