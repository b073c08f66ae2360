"""TensorFlow model-split under Horovod: each worker splits the model over two devices, workers are DP.

    horovodrun -np 2 --gloo python tf_model_split_step.py --micro-batches 3 --out r.json

Each worker sees two logical CPU devices (GPUs when it has them) and runs one stage on each;
gradients are averaged across workers by the same TrainStep a generated project uses. Every
rank also trains the unsplit model on the whole global batch in-process and compares the losses
and its variables after the steps. Rank 0 writes all ranks' results as JSON.
"""

import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_driver import parse_args, write_results  # noqa: E402
from tf_pipeline_step import CLASSES, FEATURES, LOSS, make_model, named_variables, reference, rel  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
from hvd_runtime.tf import GradientSync, TrainStep, init_horovod  # noqa: E402
from hvd_runtime.tf.model_split import ModelSplit  # noqa: E402


def main():
    args = parse_args(pipeline=False)
    ctx = init_horovod(seed=0, threads_per_rank=1, devices_per_rank=2)
    rng = np.random.default_rng(7)
    n = args.batch * ctx.size
    xs = [rng.standard_normal((n, FEATURES)).astype("float32") for _ in range(args.steps)]
    ys = [rng.integers(0, CLASSES, n) for _ in range(args.steps)]
    ref_losses, _, _, ref_updates = reference(xs, ys, xs[0], ys[0])

    model = make_model(seed=1234 + 1000 * ctx.rank)     # rank 0's start is broadcast to all
    split = ModelSplit(model, stages=2, micro_batches=args.micro_batches)
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build(split.trainable_variables)
    hvd.broadcast_variables([v.value for v in split.variables], root_rank=0)
    before = {k: v.numpy().copy() for k, v in named_variables(model.layers).items()}
    step = TrainStep(split, optimizer, LOSS, GradientSync())
    shard = slice(ctx.rank * args.batch, (ctx.rank + 1) * args.batch)
    losses = []
    for x, y in zip(xs, ys):
        loss, _ = step(tf.constant(x[shard]), tf.constant(y[shard]))
        losses.append(float(hvd.allreduce(loss, op=hvd.Average, name="loss")))

    update_err = {k: rel(v.numpy() - before[k], ref_updates[k]) for k, v in named_variables(model.layers).items()}
    blocks = [[layer.name for layer in s.layers] for s in split.stages]
    write_results(hvd, {"rank": ctx.rank, "losses": losses, "ref_losses": ref_losses,
                        "update_err": update_err, "devices": split.devices, "blocks": blocks,
                        "logical_cpus": len(tf.config.list_logical_devices("CPU"))}, args.out)


if __name__ == "__main__":
    main()
