"""The loss and accuracy every generated model trains with: a classifier's and a language model's alike.

A classifier answers (batch, classes) for targets (batch,); a language model (batch, tokens,
vocabulary) for targets (batch, tokens). Both are cross-entropy over the last axis, and a
sample's accuracy is the share of its positions predicted right, so the loops weight samples the
same way for both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of every sample (computed in fp32 under autocast)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


def accuracy_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The sum over samples of each sample's share of positions predicted right."""
    hits = (output.argmax(dim=-1) == target).float()
    return hits.reshape(len(target), -1).mean(dim=1).sum()


def accuracy(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """A pipeline engine's metrics_fn: the batch's mean accuracy, a tensor where it was computed (no host sync)."""
    return {"accuracy": accuracy_sum(output, target) / len(target)}
