"""Per-rank mini-batches over in-memory tensors.

A DataLoader with a DistributedSampler fetches samples one by one through Python and collates
them; for data that fits in memory, slicing a tensor with an index vector does the same work in
one call. Shards come from hvd_runtime.data.shard_indices: disjoint, and padded for training so
that every rank takes the same number of steps (the allreduce needs it).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from hvd_runtime.data import Split, batch_count, shard_indices


class ShardedBatches:
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0,
                 train: bool = True, device: torch.device | str = "cpu", drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.x = torch.from_numpy(split.x).to(device)
        self.y = torch.from_numpy(split.y).to(device)
        self.batch_size, self.rank, self.size = batch_size, rank, size
        self.seed, self.train, self.drop_last = seed, train, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch`, as every rank does with the same seed."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.train:
            return batch_count(len(self.y), self.size, self.batch_size, self.drop_last)
        return -(-len(self._indices()) // self.batch_size)

    def _indices(self) -> np.ndarray:
        return shard_indices(len(self.y), self.rank, self.size, self.epoch, self.seed,
                             shuffle=self.train, pad=self.train)

    def batches(self, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of this epoch from batch number `start` on (to resume mid-epoch)."""
        index = torch.from_numpy(self._indices()).to(self.x.device)
        for b in range(start, len(self)):
            chunk = index[b * self.batch_size:(b + 1) * self.batch_size]
            yield self.x.index_select(0, chunk), self.y.index_select(0, chunk)

    def __iter__(self):
        return self.batches()
