"""BatchNorm with statistics over the global batch, on CPU and GPU alike.

Horovod's own SyncBatchNorm accepts only CUDA tensors, so CPU jobs (and tests) could not use it.
This one allreduces each channel's sum, sum of squares and count in one differentiable
hvd.allreduce: the forward pass normalises with the global mean and variance, and autograd
carries the cross-rank terms of the gradient back through the same allreduce.
"""

from __future__ import annotations

import torch
from torch import nn


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import horovod.torch as hvd

        self._check_input_dim(x)
        if not self.training or hvd.size() == 1:
            return super().forward(x)
        channels = x.size(1)
        dims = [0, *range(2, x.dim())]
        count = torch.full((1,), x.numel() / channels, dtype=x.dtype, device=x.device)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = hvd.allreduce(local, op=hvd.Sum)  # differentiable: backward allreduces the gradient
        n = total[-1]
        mean = total[:channels] / n
        var = (total[channels:2 * channels] / n - mean * mean).clamp_min(0.0)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n.detach())
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        self.num_batches_tracked += 1
        factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        unbiased = var * n / (n - 1).clamp_min(1.0)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def use_sync_batchnorm(model: nn.Module) -> nn.Module:
    """Swap every BatchNorm for SyncBatchNorm, keeping its weights; the model file stays as it is.

    With small per-rank batches local statistics are noisy; syncing makes N ranks normalise like
    one big batch.
    """
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, SyncBatchNorm):
            synced = SyncBatchNorm(child.num_features, eps=child.eps, momentum=child.momentum,
                                   affine=child.affine, track_running_stats=child.track_running_stats)
            synced.load_state_dict(child.state_dict())
            setattr(model, name, synced.to(next(child.parameters(), child.running_mean).device)
                    if (child.affine or child.track_running_stats) else synced)
        else:
            use_sync_batchnorm(child)
    return model
