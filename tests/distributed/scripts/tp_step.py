"""One training step of an MLP split by tensor parallelism, against the unsplit MLP in the same process.

    horovodrun -np 2 --gloo python tp_step.py --tp 2 --out r.json      # tp=2
    horovodrun -np 4 --gloo python tp_step.py --tp 2 --out r.json      # tp=2 x dp=2

Every rank builds the same MLP (Linear, GELU, Linear, GELU, Linear) and runs the whole global
batch through it as the reference. Its split copy has the first two linears as a column-parallel /
row-parallel pair over the rank's tensor-parallel group and the last one whole; the rank feeds it
its data-parallel replica's share of the batch, and Horovod averages gradients over the replicas.
Each rank reports the relative error of its outputs, its input's gradient and every parameter's
gradient against the matching slice of the reference; rank 0 writes all ranks' reports as JSON.
"""

import argparse
import copy
import json

import horovod.torch as hvd
import torch
from torch import nn

from hvd_runtime.parallel.tensor_groups import TensorLayout
from hvd_runtime.torch.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorGroup

FEATURES, HIDDEN, OUT, BATCH = 12, 16, 5, 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from hvd_runtime.pipeline_grid import launched_world_size

    layout = TensorLayout(world=launched_world_size() or 1, tp=args.tp)
    wanted = layout.process_set_ranks()
    sets = [hvd.ProcessSet(r) for r in wanted]
    hvd.init(process_sets=sets)
    by_ranks = {tuple(r): s for r, s in zip(wanted, sets)}
    rank = hvd.rank()
    group = TensorGroup.of(layout, rank, by_ranks)
    dp_ranks = tuple(layout.dp_ranks(rank))
    dp_set = by_ranks.get(dp_ranks) if len(dp_ranks) > 1 else None
    if dp_set is None and len(dp_ranks) == layout.world > 1:
        dp_set = hvd.global_process_set

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                          nn.Linear(HIDDEN, OUT))
    g = torch.Generator().manual_seed(11)
    x, target = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUT, generator=g)

    # The reference: the whole batch through the whole model, mean squared error over the batch.
    ref_x = x.clone().requires_grad_(True)
    ref_out = model(ref_x)
    nn.functional.mse_loss(ref_out, target).backward()

    # The split copy, on this replica's share of the batch.
    split = nn.Sequential(ColumnParallelLinear(model[0], group), nn.GELU(), RowParallelLinear(model[2], group),
                          nn.GELU(), copy.deepcopy(model[4]))
    share = slice(rank // layout.tp * BATCH // layout.dp, (rank // layout.tp + 1) * BATCH // layout.dp)
    my_x = x[share].clone().requires_grad_(True)
    out = split(my_x)
    nn.functional.mse_loss(out, target[share]).backward()
    for p in split.parameters():  # the replicas' mean: the gradient of the global batch's mean
        if dp_set is not None:
            p.grad = hvd.allreduce(p.grad, op=hvd.Average, process_set=dp_set)

    cols = slice(group.rank * HIDDEN // layout.tp, (group.rank + 1) * HIDDEN // layout.tp)
    errors = {
        "output": rel(out.detach(), ref_out.detach()[share]),
        # each replica's loss is a mean over its share: dp times the global mean's weight per sample
        "input_grad": rel(my_x.grad / layout.dp, ref_x.grad[share]),
        "column.weight": rel(split[0].weight.grad, model[0].weight.grad[cols]),
        "column.bias": rel(split[0].bias.grad, model[0].bias.grad[cols]),
        "row.weight": rel(split[2].weight.grad, model[2].weight.grad[:, cols]),
        "row.bias": rel(split[2].bias.grad, model[2].bias.grad),
        "last.weight": rel(split[4].weight.grad, model[4].weight.grad),
        "last.bias": rel(split[4].bias.grad, model[4].bias.grad),
    }
    report = {"rank": rank, "tp_rank": group.rank, "errors": errors,
              "split_params": [tuple(split[0].weight.shape), tuple(split[2].weight.shape)],
              "whole_params": [tuple(model[0].weight.shape), tuple(model[2].weight.shape)]}
    reports = hvd.allgather_object(report)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(reports, f)


if __name__ == "__main__":
    main()
