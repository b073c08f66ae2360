"""model-split under Horovod: each worker splits the model over its devices, workers are data parallel.

    horovodrun -np 2 --gloo python model_split_step.py --micro-batches 3 --out r.json
    horovodrun -np 2 --gloo python model_split_step.py --model gpt --project DIR --clip-norm 0.1 --out r.json
    horovodrun -np 2 --gloo python model_split_step.py --cases cases.json   # several cases, one job

Every rank also trains the whole model on the whole global batch in-process and compares the
losses and its parameters after the steps (for a model with BatchNorm, the reference sees each
worker's micro-batches one after the other, since BatchNorm's statistics are a micro-batch's).
With --clip-norm, the split model steps as generated projects do (hvd_runtime Precision:
synchronize, clip, step without a second synchronize) and the reference clips the whole batch's
gradients. Rank 0 writes all ranks' results as JSON.
"""

import horovod.torch as hvd
import torch

from step_driver import each_case, parse_args, write_results
from pipeline_step import make_model, mlp_batch, rel  # noqa: E402
from workloads import load_workload

from hvd_runtime.torch.model_split import ModelSplit  # noqa: E402
from hvd_runtime.torch.objective import cross_entropy  # noqa: E402
from hvd_runtime.torch.precision import Precision  # noqa: E402


def reference_chunks(x, y, workers: int, micro_batches: int | None):
    """(x, y, weight) pieces whose weighted losses add up to the global batch's mean loss."""
    if micro_batches is None:
        return [(x, y, 1.0)]
    pieces = []
    for xs, ys in zip(x.tensor_split(workers), y.tensor_split(workers)):
        for xc, yc in zip(xs.tensor_split(micro_batches), ys.tensor_split(micro_batches)):
            pieces.append((xc, yc, len(yc) / len(ys) / workers))
    return pieces


def main():
    args = parse_args(pipeline=False, cases=True)
    hvd.init()
    torch.set_num_threads(1)
    for case_args in each_case(args):
        run_case(case_args)


def run_case(args):
    work = load_workload(args.model, args.project, make_model, mlp_batch)
    g = torch.Generator().manual_seed(7)
    n = args.batch * hvd.size()
    batches = [work.batch(g, n) for _ in range(args.steps)]

    ref = work.build()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    ref_losses, clipped = [], []
    for x, y in batches:
        ref_opt.zero_grad()
        total = 0.0
        for xc, yc, weight in reference_chunks(x, y, hvd.size(), args.micro_batches if work.batch_norm else None):
            loss = cross_entropy(ref(xc), yc) * weight
            loss.backward()
            total += loss.item()
        if args.clip_norm:
            clipped.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), args.clip_norm).item() > args.clip_norm)
        ref_opt.step()
        ref_losses.append(total)

    model = ModelSplit(work.build(), stages=2, micro_batches=args.micro_batches)
    # Horovod: broadcast the start, average gradients over workers
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr), named_parameters=model.named_parameters())
    precision = Precision("fp32", "cpu", clip_norm=args.clip_norm)
    shard = slice(hvd.rank() * args.batch, (hvd.rank() + 1) * args.batch)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = cross_entropy(model(x[shard]), y[shard].to(model.output_device))
        precision.backward(loss)
        precision.step(opt, model.parameters())
        losses.append(hvd.allreduce(loss.detach(), name="loss").item())

    # Parameters, not buffers: BatchNorm's running statistics are each worker's own by design.
    after = dict(ref.named_parameters())
    update_err = {}
    for stage in model.stages:
        for name, p in stage.named_parameters():   # stage names are the model's own
            update_err[name] = rel(p.detach() - before[name], after[name].detach() - before[name])
    write_results(hvd, {"rank": hvd.rank(), "losses": losses, "ref_losses": ref_losses, "clipped": clipped,
                        "update_err": update_err, "params": sorted(after),
                        "devices": [str(d) for d in model.devices]}, args.out)


if __name__ == "__main__":
    main()
