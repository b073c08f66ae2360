"""Train a few steps with the pipeline and, in the same process, with the whole model; compare.

    horovodrun -np 2 --gloo python pipeline_step.py --stages 2 --schedule 1f1b --micro-batches 4 --out r.json

Every rank computes the single-process reference itself (the whole global batch through the
whole model, plain SGD; for a model with BatchNorm, the same micro-batches one after the other,
since BatchNorm's statistics are a micro-batch's) and compares its own stage's parameters after
the steps, and the reported losses and accuracies, with it. Rank 0 writes all ranks' results as JSON.
`--model resnet18|gpt --project DIR` splits a generated project's model instead of the MLP here;
`--recompute` makes the stage's blocks recompute their activations in backward (the reference
does not); `--zero 1` shards the stage's optimizer state over its replicas (horovod.zero 1), with
`--momentum` giving it a state (both optimizers' SGD momentum).

`--cases FILE`: a JSON list of cases, each a dict of flags (dest names: schedule, micro_batches,
model, project, clip_norm, batch, partition, steps, run_dir, out) over the command line's, run one
after the other in this job on one init_pipeline (whose flags, stages, p2p, tp and chunks, are the
command line's). A job's start-up (torch, its compiler stack, Horovod, the links) costs as much as
a case: test_pipeline_torch.py runs the cases that share a grid in one job.
"""

import horovod.torch as hvd
import torch
from torch import nn

from hvd_runtime.torch.objective import accuracy_sum, cross_entropy
from hvd_runtime.torch.pipeline import PipelineEngine, build_stage, init_pipeline
from hvd_runtime.torch.recompute import recompute_blocks
from hvd_runtime.torch.tensor_parallel import slice_model
from hvd_runtime.torch.tensor_state import SlicedParameters
from hvd_runtime.torch.vocab_parallel import VocabObjective
from hvd_runtime.torch.zero import ZeroOptimizer

from step_driver import drive_pipeline, each_case, parse_args, write_results
from workloads import VOCAB, load_workload

FEATURES, CLASSES, WIDTH = 16, 5, 32


def make_model(flatten_first: bool = False) -> nn.Sequential:
    """Seven blocks; with flatten_first, a weight-free nn.Flatten before them (a stage may hold only it)."""
    torch.manual_seed(1234)
    blocks = [nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
              nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)]
    return nn.Sequential(*([nn.Flatten()] if flatten_first else []), *blocks)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.is_floating_point():  # a step counter (BatchNorm's num_batches_tracked): exact or not
        return float(not torch.equal(a, b))
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def mlp_batch(g, n):
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def reference_step(ref, opt, x, y, micro_batches: int | None, clip_norm: float) -> tuple[float, float, bool]:
    """One SGD step of the whole model: the whole batch, or (BatchNorm) the pipeline's micro-batches.

    With micro-batches each chunk's loss is weighted by its share of the batch, so the summed
    gradients are the whole batch's mean. Returns loss, accuracy and whether clipping acted.
    """
    opt.zero_grad()
    chunks = list(zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches))) if micro_batches else [(x, y)]
    loss_total, hits = 0.0, 0.0
    for xc, yc in chunks:
        out = ref(xc)
        loss = cross_entropy(out, yc) * (len(yc) / len(y))
        loss.backward()
        loss_total += loss.item()
        hits += accuracy_sum(out.detach(), yc).item()
    clipped = False
    if clip_norm:
        clipped = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm).item() > clip_norm
    opt.step()
    return loss_total, hits / len(y), clipped


def main():
    from p2p_links import links   # bench/: the links other than the socket link (helpers.bench_links)

    args = parse_args(pipeline=True, cases=True)
    if args.hvd_init_first:
        hvd.init()          # a program that started Horovod itself: the process sets are added afterwards
    _, place = init_pipeline(stages=args.stages, threads_per_rank=1, tp=args.tp, chunks=args.chunks,
                             links=links(args.p2p))
    for case_args in each_case(args):
        write_results(hvd, run_case(case_args, place), case_args.out)


def run_case(args, place) -> dict:
    """Train args.steps steps with this rank's stage and with the whole model; return what to compare."""
    work = load_workload(args.model, args.project, lambda: make_model(args.flatten_first), mlp_batch)
    g = torch.Generator().manual_seed(7)
    global_batch = args.batch * place.replicas
    batches = [work.batch(g, global_batch) for _ in range(args.steps)]
    xs, ys = [b[0] for b in batches], [b[1] for b in batches]
    x_val, y_val = work.batch(g, 3 * global_batch)

    # the single-process reference
    ref = work.build()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr, momentum=args.momentum)
    ref_losses, ref_accs, clipped = [], [], []
    for x, y in zip(xs, ys):
        loss, acc, was_clipped = reference_step(ref, ref_opt, x, y, args.micro_batches if work.batch_norm else None,
                                                args.clip_norm)
        ref_losses.append(loss)
        ref_accs.append(acc)
        clipped.append(was_clipped)
    ref.eval()
    with torch.no_grad():
        ref_val = cross_entropy(ref(x_val), y_val).item()

    # the pipeline: this rank's stage of a fresh copy of the same model
    stage = build_stage(work.build(), place, partition=args.partition, sample=xs[0][: args.batch])
    if args.tp > 1:  # each stage's blocks, embedding and head split over its tensor-parallel group
        stage = slice_model(stage, place.tensor_group)
    if args.recompute:  # each micro-batch's blocks run again in its backward
        recompute_blocks(stage)
    # the last stage's logits are split over the vocabulary at tp > 1: its loss and accuracy sum over the group
    objective = VocabObjective.of(place.tensor_group, VOCAB)
    weights = list(stage.parameters()) or [{"params": []}]  # a weight-free stage, as plain_optimizer does
    optimizer = ZeroOptimizer(stage, lambda tensors: torch.optim.SGD(tensors or [{"params": []}], lr=args.lr,
                                                                     momentum=args.momentum),
                              args.zero, place.dp_set, place.replica, place.replicas) if args.zero else \
        torch.optim.SGD(weights, lr=args.lr, momentum=args.momentum)
    engine = PipelineEngine(stage, place, loss_fn=objective.cross_entropy, optimizer=optimizer,
                            schedule=args.schedule, micro_batches=args.micro_batches, metrics_fn=objective.accuracy,
                            timeline=args.run_dir is not None, clip_norm=args.clip_norm)
    run = drive_pipeline(engine, place, xs, ys, x_val, y_val, args)

    after = ref.state_dict()
    slicings = SlicedParameters(stage).by_name  # tensor parallelism: this rank holds a slice of these

    def held(name, tensor):
        """The part of a reference tensor this rank's stage holds."""
        slicing = slicings.get(name)
        return tensor if slicing is None else tensor.index_select(slicing.dim, slicing.index)

    update_err = {name: rel(p.detach() - held(name, before[name]), held(name, after[name] - before[name]))
                  for name, p in stage.state_dict().items()}
    result = {"rank": place.rank, "stage": place.stage, "replica": place.replica,
              "tp_rank": place.tensor_group.rank if place.tensor_group else 0,
              "sliced_params": sorted(slicings), "blocks": list(stage.plan.stage_names(place.stage)),
              "chunk_blocks": stage.chunk_names,
              "ref_losses": ref_losses, "ref_accs": ref_accs, "ref_val_loss": ref_val, "update_err": update_err,
              "clipped": clipped, "weights": sum(1 for p in stage.parameters() if p.requires_grad),
              "weights_put_off": engine.split_backward.weights_put_off if engine.split_backward else None,
              "linears": sum(1 for m in stage.modules() if type(m) is torch.nn.Linear),
              "linears_batched": engine.linears_batched, **run}
    if args.momentum:   # the optimizer state this rank holds, as a share of its stage's parameters
        held = sum(v.numel() for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor))
        result["optimizer_share"] = held / max(1, sum(p.numel() for p in stage.parameters()))
    return result


if __name__ == "__main__":
    main()
