"""What the pipeline and model-split step scripts share, whichever framework they run.

The arguments they take, and the drive of a pipeline engine over the global batches: each
replica takes its shard, a middle stage passes only the batch size, and the evaluation runs over
two uneven batches. Arrays may be torch tensors or NumPy arrays (both slice the same way).
"""

import argparse
import faulthandler
import json
from pathlib import Path


def parse_args(pipeline: bool, p2p: str = "torch", cases: bool = False) -> argparse.Namespace:
    """The common flags; with pipeline=True also stages, schedule, link (default `p2p`), partition
    and timeline; with cases=True, --cases FILE (several cases in one job, each with its own --out)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, default=4 if pipeline else 3)
    ap.add_argument("--batch", type=int, default=10, help="per replica (pipeline) or per worker (model-split)")
    ap.add_argument("--steps", type=int, default=2)
    if cases:
        ap.add_argument("--cases", default=None, help="a JSON list of cases: dicts of flags over these (each an out)")
    ap.add_argument("--out", required=not cases)
    ap.add_argument("--watchdog", type=float, default=150, help="seconds before a hung rank dumps its stack and exits")
    ap.add_argument("--model", default="mlp", help="mlp, resnet18 or gpt (the last two from --project)")
    ap.add_argument("--project", default=None, help="a project generated with that --model")
    ap.add_argument("--clip-norm", type=float, default=0.0, help="clip gradients to this global norm")
    ap.add_argument("--lr", type=float, default=0.5, help="SGD learning rate, pipeline and reference alike")
    ap.add_argument("--recompute", action="store_true",
                    help="the split model's blocks recompute their activations in backward; the reference does not")
    if pipeline:
        ap.add_argument("--stages", type=int, default=2)
        ap.add_argument("--zero", type=int, default=0, help="horovod.zero 1: each replica steps its rows")
        ap.add_argument("--momentum", type=float, default=0.0, help="SGD momentum, pipeline and reference alike")
        ap.add_argument("--tp", type=int, default=1, help="split each stage over this many ranks (tensor parallelism)")
        ap.add_argument("--schedule", default="1f1b")
        ap.add_argument("--chunks", type=int, default=1, help="the model's chunks per rank (interleaved-1f1b)")
        ap.add_argument("--p2p", default=p2p, help="torch: torch, socket, alltoall or broadcast; TF: socket or alltoall")
        ap.add_argument("--partition", default="params", help="params, time, or comma-separated stage starts")
        ap.add_argument("--run-dir", default=None)
        ap.add_argument("--hvd-init-first", action="store_true", help="torch only: hvd.init() before init_pipeline")
        ap.add_argument("--flatten-first", action="store_true",
                        help="the model starts with a weight-free block (a flatten)")
        ap.add_argument("--regularize", action="store_true",
                        help="TensorFlow: L2 kernel regularizers on the MLP's Dense layers, on every stage")
    args = ap.parse_args()
    if cases and not (args.cases or args.out):
        ap.error("give --out FILE (one case, the command line's) or --cases FILE")
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if pipeline:
        args.partition = _partition(args.partition)
    return args


def _partition(value):
    """params, time, or the blocks that start each stage but the first (`4` or `2,4,6`)."""
    return value if not isinstance(value, str) or value in ("params", "time") else value.split(",")


def each_case(args: argparse.Namespace):
    """The command line's case, or each case of --cases over it: a copy of args per case, with
    its own watchdog (a hung case still ends the job)."""
    for case in json.loads(Path(args.cases).read_text()) if args.cases else [{}]:
        case_args = argparse.Namespace(**{**vars(args), **case})
        if hasattr(case_args, "partition"):   # pipeline scripts
            case_args.partition = _partition(case_args.partition)
        faulthandler.dump_traceback_later(case_args.watchdog, exit=True)
        yield case_args


def loop_step(engine, x, y, step: int) -> tuple[float, dict[str, float]]:
    """One step as hvd_runtime.loop takes it: `train_batch` with no collective, then the loop's
    sums over the job: every rank's loss adds in, only ranks that report a loss count their batch."""
    from hvd_runtime.loop import means_over_ranks

    loss, sums = engine.train_batch(x, y, True, step)
    n = int(y.shape[0])
    means = means_over_ranks({"loss": loss * n, **sums}, n if engine.reports_loss else 0, engine.sum_over_ranks,
                             "test.loop_step")
    return means.pop("loss"), means


def drive_pipeline(engine, place, xs, ys, x_val, y_val, args) -> dict:
    """Train on every global batch and evaluate; return losses, accuracies, peak in flight, val loss.

    The last batch goes the way hvd_runtime.loop drives an engine (every rank given x and y), the
    others through `train_step`, whose loss and metrics come back averaged over the job."""
    shard = slice(place.replica * args.batch, (place.replica + 1) * args.batch)
    losses, accs, peaks = [], [], []
    for k, (x, y) in enumerate(zip(xs, ys)):
        if k == len(xs) - 1:
            loss, metrics = loop_step(engine, x[shard], y[shard], k)
        # a middle stage needs neither inputs nor targets, only the batch size
        elif place.is_first or place.is_last:
            loss, metrics = engine.train_step(x[shard] if place.is_first else None, y[shard] if place.is_last else None)
        else:
            loss, metrics = engine.train_step(batch_size=args.batch)
        losses.append(loss)
        peaks.append(engine.peak_in_flight)
        accs.append(metrics["accuracy"])
    val_shard = slice(place.replica * 3 * args.batch, (place.replica + 1) * 3 * args.batch)
    vx, vy = x_val[val_shard], y_val[val_shard]
    val_loss, _ = engine.evaluate([(vx[:args.batch], vy[:args.batch]), (vx[args.batch:], vy[args.batch:])])
    if args.run_dir:
        engine.save_timeline(args.run_dir)
    return {"losses": losses, "accs": accs, "peak_in_flight": max(peaks), "val_loss": val_loss}


def write_results(hvd, result: dict, out: str) -> None:
    """Every rank calls: rank 0 writes all ranks' results, in rank order, as one JSON list."""
    results = hvd.allgather_object(result)
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
