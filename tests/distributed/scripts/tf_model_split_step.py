"""TensorFlow model-split under Horovod: each worker splits the model over two devices, workers are DP.

    horovodrun -np 2 --gloo python tf_model_split_step.py --micro-batches 3 --out r.json
    horovodrun -np 2 --gloo python tf_model_split_step.py --model gpt --project DIR --clip-norm 0.1 --out r.json
    horovodrun -np 2 --gloo python tf_model_split_step.py --cases cases.json   # several cases, one job

Each worker sees two logical CPU devices (GPUs when it has them) and runs one stage on each;
gradients are averaged across workers by the same TrainStep a generated project uses, and with
--clip-norm the optimizer clips them after the allreduce, as a generated project's does. Every
rank also trains the whole model on the whole global batch in-process (for a model with
BatchNorm, each worker's micro-batches one after the other, since BatchNorm's statistics are a
micro-batch's) and compares the losses and its trainable variables after the steps (BatchNorm's
moving statistics are each worker's own by design). Rank 0 writes all ranks' results as JSON.
"""

import hvd_runtime.tf  # noqa: F401  first, as a generated train.py: TensorFlow without Keras' unused extras
import keras
import numpy as np
import tensorflow as tf

from step_driver import each_case, parse_args, write_results
from tf_pipeline_step import BLOCKS, LOSS, make_model, mlp_batch, named_variables, reference, rel, sized_chunks  # noqa: E402
from tf_workloads import load_workload

import horovod.tensorflow as hvd  # noqa: E402
from hvd_runtime.tf import GradientSync, TrainStep, init_horovod  # noqa: E402
from hvd_runtime.tf.model_split import ModelSplit  # noqa: E402


def worker_micro_batches(workers: int, micro_batches: int):
    """(x, y, weight) pieces: each worker's shard cut as ModelSplit cuts it, weighted to the global mean."""
    def pieces(x, y):
        return [(xc, yc, w * ws) for xs, ys, ws in sized_chunks(x, y, workers)
                for xc, yc, w in sized_chunks(xs, ys, micro_batches)]
    return pieces


def main():
    args = parse_args(pipeline=False, cases=True)
    ctx = init_horovod(seed=0, threads_per_rank=1, devices_per_rank=2)
    for case_args in each_case(args):
        run_case(case_args, ctx)


def run_case(args, ctx):
    work = load_workload(args.model, args.project, make_model, mlp_batch, BLOCKS)
    rng = np.random.default_rng(7)
    n = args.batch * ctx.size
    batches = [work.batch(rng, n) for _ in range(args.steps)]
    xs, ys = [b[0] for b in batches], [b[1] for b in batches]
    pieces = worker_micro_batches(ctx.size, args.micro_batches) if work.batch_norm else None
    ref_losses, _, _, ref_updates, clipped = reference(xs, ys, xs[0], ys[0], work=work, pieces=pieces,
                                                       clip_norm=args.clip_norm, lr=args.lr, trainable_only=True)

    model = work.build(1234 + 1000 * ctx.rank)     # rank 0's start is broadcast to all
    split = ModelSplit(model, stages=2, micro_batches=args.micro_batches)
    optimizer = keras.optimizers.SGD(args.lr, global_clipnorm=args.clip_norm or None)
    optimizer.build(split.trainable_variables)
    hvd.broadcast_variables([v.value for v in split.variables], root_rank=0)
    before = {k: v.numpy().copy() for k, v in named_variables(model.layers, trainable_only=True).items()}
    step = TrainStep(split, optimizer, LOSS, GradientSync())
    shard = slice(ctx.rank * args.batch, (ctx.rank + 1) * args.batch)
    losses = []
    for x, y in zip(xs, ys):
        loss, _, _ = step(tf.constant(x[shard]), tf.constant(y[shard]))
        losses.append(float(hvd.allreduce(loss, op=hvd.Average, name="loss")))

    update_err = {k: rel(v.numpy() - before[k], ref_updates[k])
                  for k, v in named_variables(model.layers, trainable_only=True).items()}
    blocks = [[layer.name for layer in s.layers] for s in split.stages]
    write_results(hvd, {"rank": ctx.rank, "losses": losses, "ref_losses": ref_losses, "clipped": clipped,
                        "update_err": update_err, "params": sorted(ref_updates), "devices": split.devices,
                        "blocks": blocks, "logical_cpus": len(tf.config.list_logical_devices("CPU"))}, args.out)


if __name__ == "__main__":
    main()
