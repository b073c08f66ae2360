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

import functools
import os
import select
import threading
import time
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from hvd_runtime.data import DataError, EpochShards, Split


class _Batches(torch.utils.data.Dataset):
    """Item = one batch: (epoch, sample indices) in, (inputs, targets) tensors out."""

    def __init__(self, split):
        self.split = split

    def __getitem__(self, request: tuple[int, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor] | DataError:
        epoch, indices = request
        try:
            x, y = self.split.take(indices, epoch)
        except DataError as exc:  # handed back whole: the DataLoader would wrap it in a worker traceback
            return exc
        return torch.from_numpy(x), torch.from_numpy(y)


class _Requests(torch.utils.data.Sampler):
    """The batches of the next pass over the data, set before the pass: the loader and its
    worker processes stay the same from pass to pass, the requests change."""

    def __init__(self):
        self.requests: list[tuple[int, np.ndarray]] = []

    def __iter__(self):
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)


def worker_context():
    """How DataLoader workers start: from a fork server where the platform has one.

    Why: a rank is multi-threaded once Horovod runs (its background loop, Gloo's threads, the
    progress bar's monitor), and a process forked from a multi-threaded one can inherit a lock
    that a thread of the parent held at that instant, and wait for it forever. Seen here: a
    tensor-parallel job hung in evaluation, a DataLoader worker blocked in a futex right after
    fork. The fork server is a fresh single-threaded process (torch preloaded), so workers fork
    from it instead; they are started once per split and kept (persistent_workers)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None  # Windows: spawn, the platform's default
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", __name__])
    return context


def end_with_rank(rank_pid: int, worker_id: int) -> None:
    """DataLoader's worker_init_fn: this worker ends as soon as its rank has ended, however it ended.

    Why: a worker forked from the fork server watches its parent, the fork server, not the rank;
    the fork server waits for every process holding its liveness pipe, the workers among them. So
    a rank killed outright (SIGKILL: the kernel's OOM killer, a fault) would leave its fork server
    and workers running, holding the rank's stdout and stderr: horovodrun waited on those pipes
    forever instead of ending the job, and no retry came. A thread waits on the rank (a pidfd; a
    poll each second where there is none) and ends the worker; the fork server then ends too."""
    def watch() -> None:
        try:
            fd = os.pidfd_open(rank_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(rank_pid):
                time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="hvdgen-rank-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShardedBatches(EpochShards):
    def __init__(self, split: Split, batch_size: int, rank: int, size: int, *, seed: int = 0,
                 train: bool = True, device: torch.device | str = "cpu", workers: int = 0):
        super().__init__(len(split), batch_size, rank, size, seed=seed, train=train)
        self.split, self.device, self.workers = split, torch.device(device), workers
        self._loader: DataLoader | None = None  # made on the first streamed pass, kept with its workers
        if split.streamed:
            if workers > 0:
                iter(self._streaming_loader())  # the workers start now, while the rank builds its model
        else:
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
        loader = self._streaming_loader()
        loader.sampler.requests = [(epoch, index[start:start + self.batch_size])
                                   for start in range(0, len(index), self.batch_size)]
        for batch in loader:
            if isinstance(batch, DataError):
                raise batch  # a file gone bad since start-up: one config-error line, not a traceback
            x, y = batch
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _streaming_loader(self) -> DataLoader:
        if self._loader is None:
            workers = max(0, self.workers)
            self._loader = DataLoader(
                _Batches(self.split), sampler=_Requests(), batch_size=None, num_workers=workers,
                pin_memory=self.device.type == "cuda", persistent_workers=workers > 0,
                multiprocessing_context=worker_context() if workers > 0 else None,
                worker_init_fn=functools.partial(end_with_rank, os.getpid()) if workers > 0 else None)
        return self._loader

    def __iter__(self):
        return self.batches()
