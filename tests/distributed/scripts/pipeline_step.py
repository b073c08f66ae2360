"""Train a few steps with the pipeline and, in the same process, with the unsplit model; compare.

    horovodrun -np 2 --gloo python pipeline_step.py --stages 2 --schedule 1f1b --micro-batches 4 --out r.json

Every rank computes the single-process reference itself (the whole global batch through the
whole model, plain SGD) and compares its own stage's parameters after the steps, and the
reported losses and accuracies, with it. Rank 0 writes all ranks' results as JSON.
"""

import sys
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

from hvd_runtime.torch.pipeline import PipelineEngine, build_stage, init_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_driver import drive_pipeline, parse_args, write_results  # noqa: E402

FEATURES, CLASSES, WIDTH = 16, 5, 32


def make_model(flatten_first: bool = False) -> nn.Sequential:
    """Seven blocks; with flatten_first, a weight-free nn.Flatten before them (a stage may hold only it)."""
    torch.manual_seed(1234)
    blocks = [nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
              nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)]
    return nn.Sequential(*([nn.Flatten()] if flatten_first else []), *blocks)


def accuracy(out, y):
    return {"accuracy": (out.argmax(1) == y).float().mean().item()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    args = parse_args(pipeline=True)

    if args.hvd_init_first:
        hvd.init()          # a program that started Horovod itself: the process sets are added afterwards
    dims = init_pipeline(stages=args.stages, p2p=args.p2p, threads=1)
    g = torch.Generator().manual_seed(7)
    global_batch = args.batch * dims.replicas
    xs = [torch.randn(global_batch, FEATURES, generator=g) for _ in range(args.steps)]
    ys = [torch.randint(0, CLASSES, (global_batch,), generator=g) for _ in range(args.steps)]
    x_val, y_val = torch.randn(3 * global_batch, FEATURES, generator=g), torch.randint(0, CLASSES, (3 * global_batch,), generator=g)

    # the single-process reference
    ref = make_model(args.flatten_first)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses, ref_accs = [], []
    for x, y in zip(xs, ys):
        ref_opt.zero_grad()
        out = ref(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
        ref_accs.append(accuracy(out, y)["accuracy"])
    with torch.no_grad():
        ref_val = F.cross_entropy(ref(x_val), y_val).item()

    # the pipeline: this rank's stage of a fresh copy of the same model
    stage = build_stage(make_model(args.flatten_first), dims, partition=args.partition, sample=xs[0][: args.batch])
    weights = list(stage.parameters()) or [{"params": []}]  # a weight-free stage, as plain_optimizer does
    engine = PipelineEngine(stage, dims, loss_fn=F.cross_entropy, optimizer=torch.optim.SGD(weights, lr=0.5),
                            schedule=args.schedule, micro_batches=args.micro_batches, metrics_fn=accuracy,
                            timeline=args.run_dir is not None)
    run = drive_pipeline(engine, dims, xs, ys, x_val, y_val, args)

    after = ref.state_dict()
    update_err = {name: rel(p.detach() - before[name], after[name] - before[name])
                  for name, p in stage.state_dict().items()}
    result = {"rank": dims.rank, "stage": dims.stage, "replica": dims.replica, "blocks": list(stage.plan.stage_names(dims.stage)),
              "ref_losses": ref_losses, "ref_accs": ref_accs, "ref_val_loss": ref_val, "update_err": update_err, **run}
    write_results(hvd, result, args.out)


if __name__ == "__main__":
    main()
