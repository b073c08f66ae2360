"""Per-rank mini-batches over in-memory tensors.

A DataLoader with a DistributedSampler fetches samples one by one through Python and collates
them; for data that fits in memory, slicing a tensor with an index vector does the same work in
one call. Which samples a rank takes comes from hvd_runtime.data.EpochShards: disjoint shards,
padded for training so that every rank takes the same number of steps (the allreduce needs it).
"""

from __future__ import annotations

from typing import Iterator

import torch

from hvd_runtime.data import EpochShards, Split


class ShardedBatches(EpochShards):
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0,
                 train: bool = True, device: torch.device | str = "cpu"):
        super().__init__(len(split), batch_size, rank, size, seed=seed, train=train)
        self.x = torch.from_numpy(split.x).to(device)
        self.y = torch.from_numpy(split.y).to(device)

    def batches(self, epoch: int = 0, consumed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of `epoch`, after the first `consumed` samples of its order."""
        index = torch.from_numpy(self.indices(epoch, consumed)).to(self.x.device)
        for start in range(0, len(index), self.batch_size):
            chunk = index[start:start + self.batch_size]
            yield self.x.index_select(0, chunk), self.y.index_select(0, chunk)

    def __iter__(self):
        return self.batches()
