"""One horovodrun rank of the data-parallel benchmark: train a few epochs, report samples/s.

    horovodrun -np 2 -H localhost:2 --gloo python bench/dp_worker.py --loop ours
    horovodrun -np 2 -H localhost:2 --gloo python bench/dp_worker.py --loop reference
    torchrun --standalone --nproc-per-node 2 bench/dp_worker.py --loop ddp

`ours` is the generated project's loop (hvd_runtime.torch); `reference` is written the way
Horovod's official PyTorch example is: a DataLoader over a TensorDataset with a
DistributedSampler, hvd.DistributedOptimizer, and parameters broadcast from rank 0; `ddp` is the
same loop over torch's DistributedDataParallel (gloo), as torchrun users write it. All three train
the same MLP on the same synthetic data with the same per-rank batch size and one thread per
rank. The first epoch warms up; the rest are timed between barriers. Rank 0 prints one
`BENCH {...}` JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import horovod.torch as hvd  # noqa: E402

from hvd_runtime.config import DataConfig, HorovodConfig, OptimConfig  # noqa: E402
from hvd_runtime.data import load_dataset  # noqa: E402


def make_model(features: int, classes: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, classes))


def barrier() -> None:
    hvd.allreduce(torch.zeros(1), name="barrier")


def run_ours(dataset, model, args) -> tuple[float, int, int]:
    from hvd_runtime.loop import train_epoch
    from hvd_runtime.torch import ShardedBatches, TrainState, TrainStep, init_horovod, make_optimizer

    ctx = init_horovod(seed=0, threads_per_rank=1, cycle_time_ms=args.cycle_time_ms)
    batches = ShardedBatches(dataset.train, args.batch_size, ctx.rank, ctx.size, seed=0)
    optim_cfg = OptimConfig(name="sgd", lr=0.01, momentum=0.9, scale_lr=True, warmup_epochs=0)
    optimizer, schedule = make_optimizer(model, optim_cfg, HorovodConfig(), ctx, len(batches))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state = TrainState()
    step = TrainStep(model, optimizer, schedule, nn.CrossEntropyLoss(), ctx)
    train_epoch(step, batches, state, is_root=ctx.is_root)  # warm-up
    barrier()
    started = time.perf_counter()
    for _ in range(args.epochs):
        train_epoch(step, batches, state, is_root=ctx.is_root)
    barrier()
    return time.perf_counter() - started, ctx.rank, ctx.size


def loader_loop(dataset, model, optimizer, size: int, rank: int, barrier_fn, args) -> float:
    """The Horovod example's epoch (and DDP's): a DataLoader over a TensorDataset with a
    DistributedSampler; only the model's and optimizer's wrappers differ."""
    torch.set_num_threads(1)
    train_set = torch.utils.data.TensorDataset(torch.from_numpy(dataset.train.x), torch.from_numpy(dataset.train.y))
    sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=size, rank=rank)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    def epoch(number: int) -> None:
        model.train()
        sampler.set_epoch(number)
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()

    epoch(0)  # warm-up
    barrier_fn()
    started = time.perf_counter()
    for number in range(1, args.epochs + 1):
        epoch(number)
    barrier_fn()
    return time.perf_counter() - started


def run_reference(dataset, model, args) -> tuple[float, int, int]:
    hvd.init()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    return loader_loop(dataset, model, optimizer, hvd.size(), hvd.rank(), barrier, args), hvd.rank(), hvd.size()


def run_ddp(dataset, model, args) -> tuple[float, int, int]:
    """torch DDP (gloo) as torchrun users write it: the same loop over DistributedDataParallel."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
    seconds = loader_loop(dataset, model, optimizer, size, rank, dist.barrier, args)
    dist.destroy_process_group()
    return seconds, rank, size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", choices=["ours", "reference", "ddp"], required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--cycle-time-ms", type=float, default=0.0, help="ours: horovod.cycle_time_ms")
    args = parser.parse_args()
    dataset = load_dataset(DataConfig(source="synthetic", synthetic_samples=args.samples, synthetic_features=64,
                                      synthetic_classes=10, val_fraction=0.05))
    model = make_model(64, 10, args.width)
    run = {"ours": run_ours, "reference": run_reference, "ddp": run_ddp}[args.loop]
    seconds, rank, size = run(dataset, model, args)
    if rank == 0:
        samples = args.epochs * len(dataset.train)
        print("BENCH " + json.dumps({"loop": args.loop, "np": size, "seconds": seconds,
                                     "samples_per_s": samples / seconds}), flush=True)


if __name__ == "__main__":
    main()
