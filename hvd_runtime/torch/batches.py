"""Per-rank mini-batches over in-memory tensors.

A DataLoader with a DistributedSampler fetches samples one by one through Python and collates
them; for data that fits in memory, slicing a tensor with an index vector does the same work in
one call. Shards come from hvd_runtime.data.shard_indices: disjoint, and padded for training so
that every rank takes the same number of steps (the allreduce needs it). Progress through an
epoch is counted in samples consumed across all ranks, which is what a resumed or resized
(elastic) job needs to carry on exactly where the epoch stopped.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from hvd_runtime.data import Split, shard_indices


class ShardedBatches:
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0,
                 train: bool = True, device: torch.device | str = "cpu"):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.x = torch.from_numpy(split.x).to(device)
        self.y = torch.from_numpy(split.y).to(device)
        self.batch_size, self.seed, self.train = batch_size, seed, train
        self.rank, self.size = rank, size

    def reshard(self, rank: int, size: int) -> None:
        """After an elastic reset: this process's new rank in a job of a new size."""
        self.rank, self.size = rank, size

    @property
    def samples(self) -> int:
        return len(self.y)

    @property
    def samples_per_step(self) -> int:
        """Samples of the epoch's order one step consumes, over all ranks."""
        return self.batch_size * self.size

    def steps(self, consumed: int = 0) -> int:
        """Steps left in an epoch of which `consumed` samples are done (the same on every rank)."""
        return math.ceil(math.ceil(max(0, self.samples - consumed) / self.size) / self.batch_size)

    def _indices(self, epoch: int, consumed: int) -> np.ndarray:
        return shard_indices(self.samples, self.rank, self.size, epoch, self.seed,
                             shuffle=self.train, pad=self.train, consumed=consumed)

    def __len__(self) -> int:
        if self.train:
            return self.steps()
        return math.ceil(len(self._indices(0, 0)) / self.batch_size)

    def batches(self, epoch: int = 0, consumed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of `epoch`, after the first `consumed` samples of its order."""
        index = torch.from_numpy(self._indices(epoch, consumed)).to(self.x.device)
        for start in range(0, len(index), self.batch_size):
            chunk = index[start:start + self.batch_size]
            yield self.x.index_select(0, chunk), self.y.index_select(0, chunk)

    def __iter__(self):
        return self.batches()
