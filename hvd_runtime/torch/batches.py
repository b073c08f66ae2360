"""Per-rank mini-batches: sliced from memory, or read from disk by DataLoader worker processes.

Which samples a rank takes comes from hvd_runtime.data.EpochShards: disjoint shards, padded for
training so that every rank takes the same number of steps (the allreduce needs it).

Data that fits in memory is sliced from tensors with an index vector: a DataLoader with a
DistributedSampler would fetch samples one by one through Python and collate them, for the same
result. A streamed split (an image folder, a token file) goes through a DataLoader whose every
item is a whole batch: `workers` processes decode batches ahead of the training step, into
pinned memory when the rank trains on a GPU.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from hvd_runtime.data import DataError, EpochShards, Split


class _EpochBatches(torch.utils.data.Dataset):
    """Item = one batch: its sample indices in, (inputs, targets) tensors out, for one epoch."""

    def __init__(self, split, epoch: int):
        self.split, self.epoch = split, epoch

    def __getitem__(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | DataError:
        try:
            x, y = self.split.take(indices, self.epoch)
        except DataError as exc:  # handed back whole: the DataLoader would wrap it in a worker traceback
            return exc
        return torch.from_numpy(x), torch.from_numpy(y)


class ShardedBatches(EpochShards):
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0,
                 train: bool = True, device: torch.device | str = "cpu", workers: int = 0):
        super().__init__(len(split), batch_size, rank, size, seed=seed, train=train)
        self.split, self.device, self.workers = split, torch.device(device), workers
        if not split.streamed:
            self.x = torch.from_numpy(split.x).to(device)
            self.y = torch.from_numpy(split.y).to(device)

    def batches(self, epoch: int = 0, consumed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of `epoch`, after the first `consumed` samples of its order."""
        if self.split.streamed:
            yield from self._streamed(epoch, consumed)
            return
        index = torch.from_numpy(self.indices(epoch, consumed)).to(self.x.device)
        for start in range(0, len(index), self.batch_size):
            chunk = index[start:start + self.batch_size]
            yield self.x.index_select(0, chunk), self.y.index_select(0, chunk)

    def _streamed(self, epoch: int, consumed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = self.indices(epoch, consumed)
        chunks = [index[start:start + self.batch_size] for start in range(0, len(index), self.batch_size)]
        loader = DataLoader(_EpochBatches(self.split, epoch), sampler=chunks, batch_size=None,
                            num_workers=min(self.workers, len(chunks)), pin_memory=self.device.type == "cuda")
        for batch in loader:
            if isinstance(batch, DataError):
                raise batch  # a file gone bad since start-up: one config-error line, not a traceback
            x, y = batch
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def __iter__(self):
        return self.batches()
