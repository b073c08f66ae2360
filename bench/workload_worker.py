"""One rank of the workload benchmark: ResNet-18 or GPT from a generated project, in one of three loops.

    horovodrun -np 2 -H localhost:2 --gloo python bench/workload_worker.py --loop ours --model gpt --project DIR
    horovodrun -np 2 -H localhost:2 --gloo python bench/workload_worker.py --loop reference ...
    torchrun --standalone --nproc-per-node 2 bench/workload_worker.py --loop ddp ...

`ours` is the generated project's loop (hvd_runtime.torch: ShardedBatches over the split,
train_epoch). `reference` is written as Horovod's official PyTorch example is: a DataLoader with a
DistributedSampler fetching one sample at a time, hvd.DistributedOptimizer, parameters broadcast
from rank 0. `ddp` is the same loop over torch's DistributedDataParallel (gloo), as torchrun users
write it. All three train the same model (the project's model.py) on the same files read from disk
(an image folder decoded per batch, or a token file read through memmap), with the same per-rank
batch, one thread per rank and no loader worker processes (2 cores). An epoch warms up, the next
is timed between barriers; rank 0 prints one `BENCH {...}` JSON line.

On a GPU (`--device cuda`, run by bench/gpu_check.py) every rank takes its local rank's GPU, the
models take their published sizes (`--size gpu`), DDP reduces over NCCL, and `--precision bf16`
runs each loop's forward pass under the same autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvd_runtime.config import HorovodConfig, ModelConfig, OptimConfig  # noqa: E402
from hvd_runtime.torch.objective import cross_entropy  # noqa: E402

# cpu: small enough for two ranks on 2 cores; gpu: ResNet-18 as published, a GPT of 8 blocks x 512.
MODEL_SIZES = {
    "cpu": {"resnet18": ModelConfig(width=16), "gpt": ModelConfig(width=64, layers=4, heads=4, context=64)},
    "gpu": {"resnet18": ModelConfig(width=64), "gpt": ModelConfig(width=512, layers=8, heads=8, context=256)},
}


class Samples(torch.utils.data.Dataset):
    """The split one sample at a time: what a DataLoader with a DistributedSampler asks for."""

    def __init__(self, split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        x, y = self.split.take(np.array([i]))
        return torch.from_numpy(x[0]), torch.as_tensor(y[0])


def load(args):
    from hvd_runtime.data import load_image_folder, load_npz, load_tokens

    sys.path.insert(0, str(Path(args.project).resolve()))
    from model import build_model

    sizes = MODEL_SIZES[args.size]
    if args.model == "gpt":
        dataset = load_tokens(args.data, context=sizes["gpt"].context)
    elif args.data.endswith(".npz"):  # images held in memory: the GPU's speed, not the decoder's
        dataset = load_npz(args.data, val_fraction=0.05)
    else:
        dataset = load_image_folder(args.data, image_size=32, val_fraction=0.05)
    torch.manual_seed(0)
    return dataset, build_model(sizes[args.model], dataset.input_shape, dataset.num_classes)


def autocast(args, device: torch.device):
    if args.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def run_ours(dataset, model, args, hvd) -> tuple[float, int]:
    from hvd_runtime.loop import train_epoch
    from hvd_runtime.torch import ShardedBatches, TrainState, TrainStep, init_horovod, make_optimizer
    from hvd_runtime.torch.precision import Precision

    ctx = init_horovod(seed=0, threads_per_rank=1)
    model.to(ctx.device)
    batches = ShardedBatches(dataset.train, args.batch_size, ctx.rank, ctx.size, seed=0, workers=0,
                             device=ctx.device)
    optim_cfg = OptimConfig(name="sgd", lr=0.01, momentum=0.9, scale_lr=True, warmup_epochs=0)
    optimizer, schedule = make_optimizer(model, optim_cfg, HorovodConfig(), ctx, len(batches))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state = TrainState()
    step = TrainStep(model, optimizer, schedule, cross_entropy, ctx, precision=Precision(args.precision, ctx.device))
    train_epoch(step, batches, state, is_root=ctx.is_root)  # warm-up
    barrier(hvd, ctx.device)
    started = time.perf_counter()
    train_epoch(step, batches, state, is_root=ctx.is_root)
    barrier(hvd, ctx.device)
    return time.perf_counter() - started, len(batches) * batches.samples_per_step


def run_loader_loop(dataset, model, args, size: int, rank: int, device: torch.device, wrap,
                    barrier_fn) -> tuple[float, int]:
    """The Horovod example's loop (and DDP's: only `wrap` differs)."""
    torch.set_num_threads(1)
    train_set = Samples(dataset.train)
    sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=size, rank=rank)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                                         pin_memory=device.type == "cuda")
    model.to(device)
    model, optimizer = wrap(model, torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9))

    def epoch(number: int) -> None:
        model.train()
        sampler.set_epoch(number)
        for data, target in loader:
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad()
            with autocast(args, device):
                loss = cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()

    epoch(0)  # warm-up
    barrier_fn()
    started = time.perf_counter()
    epoch(1)
    barrier_fn()
    return time.perf_counter() - started, len(loader) * args.batch_size * size


def barrier(hvd, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the queued steps are part of the time
    hvd.allreduce(torch.zeros(1), name="barrier")


def local_gpu(args, local_rank: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", choices=["ours", "reference", "ddp"], required=True)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES["cpu"]), required=True)
    parser.add_argument("--project", required=True, help="a project generated with that --model (its model.py)")
    parser.add_argument("--data", required=True, help="an image folder (resnet18) or a token folder (gpt)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="cpu", help="model sizes (MODEL_SIZES)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    dataset, model = load(args)

    if args.loop == "ddp":
        import torch.distributed as dist

        import os

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        device = local_gpu(args, int(os.environ.get("LOCAL_RANK", 0)))

        def wrap(m, opt):
            ids = [device.index] if device.type == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(m, device_ids=ids), opt

        def ddp_barrier():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()

        seconds, samples = run_loader_loop(dataset, model, args, size, rank, device, wrap, ddp_barrier)
        dist.destroy_process_group()
    else:
        import horovod.torch as hvd

        if args.loop == "ours":
            seconds, samples = run_ours(dataset, model, args, hvd)
        else:
            hvd.init()
            device = local_gpu(args, hvd.local_rank())

            def wrap(m, opt):
                hvd.broadcast_parameters(m.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
                return m, hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())

            seconds, samples = run_loader_loop(dataset, model, args, hvd.size(), hvd.rank(), device, wrap,
                                               lambda: barrier(hvd, device))
        rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        per_sample = MODEL_SIZES[args.size]["gpt"].context if args.model == "gpt" else 1
        print("BENCH " + json.dumps({"loop": args.loop, "model": args.model, "np": size, "seconds": seconds,
                                     "device": args.device, "precision": args.precision,
                                     "samples_per_s": samples / seconds,
                                     "items_per_s": samples * per_sample / seconds}), flush=True)


if __name__ == "__main__":
    main()
