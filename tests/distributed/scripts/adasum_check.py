"""Adasum under a real horovodrun: Horovod's op on CPU tensors, and the runtime's horovod.adasum switch.

    horovodrun -np 2 -H localhost:2 --mpi  python adasum_check.py --out r.json    # Adasum runs
    horovodrun -np 2 -H localhost:2 --gloo python adasum_check.py --out r.json    # refused on Gloo

Every rank records its inputs and what Horovod returned; rank 0 writes them all (gathered) to
--out, and the test computes Adasum's two-rank formula from the inputs in one process. With no
Adasum op in this job (Gloo), each step records the error it got instead.
"""

import argparse
import json
from pathlib import Path

import horovod.torch as hvd
import torch

from hvd_runtime.config import load_config
from hvd_runtime.torch import init_horovod, make_optimizer

SHAPES = {"vector": (1000,), "matrix": (17, 23)}


def attempt(fn):
    """fn()'s value, or the error it raised, as one JSON-able record."""
    try:
        return {"value": fn()}
    except Exception as exc:  # recorded, so the test can say what the job did
        return {"error": f"{type(exc).__name__}: {exc}"}


def tensors(rank: int) -> dict[str, torch.Tensor]:
    """Per-rank inputs from per-rank seeds, plus two cases whose Adasum is known in closed form."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    out["orthogonal"] = torch.tensor([3.0, 0.0]) if rank == 0 else torch.tensor([0.0, -2.0])  # -> the sum
    out["parallel"] = torch.tensor([1.0, 2.0, 2.0]) * (1.0 if rank == 0 else 3.0)             # a, 3a -> 2a
    return out


def op_results(rank: int) -> dict:
    inputs = tensors(rank)
    single = {name: attempt(lambda t=t, name=name: hvd.allreduce(t, op=hvd.Adasum, name=f"adasum.{name}").tolist())
              for name, t in inputs.items()}
    grouped = attempt(lambda: [r.tolist() for r in hvd.grouped_allreduce(
        [inputs["vector"], inputs["matrix"]], op=hvd.Adasum, name="adasum.grouped")])
    return {"inputs": {k: v.tolist() for k, v in inputs.items()}, "single": single, "grouped": grouped}


def optimizer_results(rank: int, ctx) -> dict:
    """One step of the runtime's optimizer with horovod.adasum true: plain SGD on a tiny model."""
    cfg = load_config(overrides=["horovod.adasum=true", "optim.name=sgd", "optim.momentum=0.0",
                                 "optim.weight_decay=0.0", "optim.warmup_epochs=0", "optim.lr=0.1"])
    torch.manual_seed(0)                    # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    before = {k: v.tolist() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(2000 + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)

    def step():
        optimizer, schedule = make_optimizer(model, cfg.optim, cfg.horovod, ctx, steps_per_epoch=10)
        schedule.apply(optimizer, 0, ctx.size, ctx.local_size)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        return {"lr": optimizer.param_groups[0]["lr"], "after": {k: v.tolist() for k, v in model.state_dict().items()}}

    return {"before": before, "x": x.tolist(), "y": y.tolist(), "step": attempt(step)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ctx = init_horovod(seed=0, threads_per_rank=1)
    mine = {"rank": ctx.rank, "mpi_enabled": hvd.mpi_enabled(), "op": op_results(ctx.rank),
            "optimizer": optimizer_results(ctx.rank, ctx)}
    everyone = hvd.allgather_object(mine, name="results")
    if ctx.rank == 0:
        Path(args.out).write_text(json.dumps({"size": ctx.size, "ranks": everyone}))


if __name__ == "__main__":
    main()
