"""model-split under Horovod: each worker splits the model over its devices, workers are data parallel.

    horovodrun -np 2 --gloo python model_split_step.py --micro-batches 3 --out r.json

Every rank also trains the unsplit model on the whole global batch in-process and compares the
losses and its parameters after the steps. Rank 0 writes all ranks' results as JSON.
"""

import sys
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_driver import parse_args, write_results  # noqa: E402
from pipeline_step import CLASSES, FEATURES, make_model, rel  # noqa: E402

from hvd_runtime.torch.model_split import ModelSplit  # noqa: E402


def main():
    args = parse_args(pipeline=False)
    hvd.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    n = args.batch * hvd.size()
    xs = [torch.randn(n, FEATURES, generator=g) for _ in range(args.steps)]
    ys = [torch.randint(0, CLASSES, (n,), generator=g) for _ in range(args.steps)]

    ref = make_model()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for x, y in zip(xs, ys):
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    model = ModelSplit(make_model(), stages=2, micro_batches=args.micro_batches)
    # Horovod: broadcast the start, average gradients over workers
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters())
    shard = slice(hvd.rank() * args.batch, (hvd.rank() + 1) * args.batch)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = F.cross_entropy(model(x[shard]), y[shard].to(model.output_device))
        loss.backward()
        opt.step()
        losses.append(hvd.allreduce(loss.detach(), name="loss").item())

    after = ref.state_dict()
    update_err = {}
    for stage in model.stages:
        for name, p in stage.state_dict().items():   # stage keys are the model's own
            update_err[name] = rel(p.detach() - before[name], after[name] - before[name])
    write_results(hvd, {"rank": hvd.rank(), "losses": losses, "ref_losses": ref_losses,
                        "update_err": update_err, "devices": [str(d) for d in model.devices]}, args.out)


if __name__ == "__main__":
    main()
