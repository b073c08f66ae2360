"""TensorFlow: train a few steps with the pipeline and, in the same process, with the unsplit model.

    horovodrun -np 2 --gloo python tf_pipeline_step.py --stages 2 --schedule 1f1b --micro-batches 4 --out r.json

Every rank computes the single-process reference itself (the whole global batch through the
whole model, plain SGD) and compares its own stage's variables after the steps, and the reported
losses and accuracies, with it. Replicas other than 0 build their copy from another seed, so
the engine's start-up broadcast is what makes them agree. Rank 0 writes all results as JSON
(the format tests/pipeline_checks.py judges).
"""

import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_runtime.tf.pipeline import PipelineEngine, build_stage, init_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_driver import drive_pipeline, parse_args, write_results  # noqa: E402

FEATURES, CLASSES, WIDTH = 16, 5, 32
BLOCKS = [f"b{i}" for i in range(7)]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(seed: int = 1234, flatten_first: bool = False) -> keras.Sequential:
    """Seven blocks: Dense and tanh in turn, named b0..b6; with flatten_first, a weight-free
    Flatten named "flat" before them (a stage may hold only it)."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((FEATURES,)), *([keras.layers.Flatten(name="flat")] if flatten_first else [])]
    for i in range(7):
        if i % 2:
            layers.append(keras.layers.Activation("tanh", name=f"b{i}"))
        else:
            layers.append(keras.layers.Dense(CLASSES if i == 6 else WIDTH, name=f"b{i}"))
    return keras.Sequential(layers)


def named_variables(layers) -> dict:
    """'b2/kernel' -> variable: the same key in any model made by make_model."""
    return {f"{layer.name}/{v.name}": v for layer in layers for v in layer.variables}


def accuracy(out, y):
    return {"accuracy": float(tf.reduce_mean(tf.cast(tf.argmax(out, 1) == tf.cast(y, tf.int64), tf.float32)))}


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def reference(xs, ys, x_val, y_val, flatten_first: bool = False):
    """The unsplit model trained in this process: losses, accuracies, val loss, updates."""
    ref = make_model(flatten_first=flatten_first)
    before = {k: v.numpy().copy() for k, v in named_variables(ref.layers).items()}
    opt = keras.optimizers.SGD(0.5)
    losses, accs = [], []
    for x, y in zip(xs, ys):
        with tf.GradientTape() as tape:
            out = ref(x, training=True)
            loss = LOSS(y, out)
        grads = tape.gradient(loss, ref.trainable_variables)
        opt.apply_gradients(zip(grads, ref.trainable_variables))
        losses.append(float(loss))
        accs.append(accuracy(out, y)["accuracy"])
    updates = {k: v.numpy() - before[k] for k, v in named_variables(ref.layers).items()}
    return losses, accs, float(LOSS(y_val, ref(x_val, training=False))), updates


def main():
    args = parse_args(pipeline=True, p2p="socket")

    ctx, dims = init_pipeline(stages=args.stages, threads_per_rank=1, p2p=args.p2p)
    rng = np.random.default_rng(7)
    global_batch = args.batch * dims.replicas
    xs = [rng.standard_normal((global_batch, FEATURES)).astype("float32") for _ in range(args.steps)]
    ys = [rng.integers(0, CLASSES, global_batch) for _ in range(args.steps)]
    x_val = rng.standard_normal((3 * global_batch, FEATURES)).astype("float32")
    y_val = rng.integers(0, CLASSES, 3 * global_batch)
    ref_losses, ref_accs, ref_val, ref_updates = reference(xs, ys, x_val, y_val, args.flatten_first)

    model = make_model(seed=1234 + 1000 * dims.replica, flatten_first=args.flatten_first)  # replica 0's must win
    stage = build_stage(model, dims, partition=args.partition, sample=xs[0][:args.batch])
    before = {k: v.numpy().copy() for k, v in named_variables(stage.layers).items()}
    engine = PipelineEngine(stage, dims, LOSS, keras.optimizers.SGD(0.5), schedule=args.schedule,
                            micro_batches=args.micro_batches, metrics_fn=accuracy, timeline=args.run_dir is not None)
    if dims.replica:
        # what replica 0 started from: the engine broadcast it over this stage's replicas
        before = {k: v.numpy().copy() for k, v in named_variables(make_model(flatten_first=args.flatten_first).layers).items()
                  if k in before}
    run = drive_pipeline(engine, dims, xs, ys, x_val, y_val, args)

    update_err = {k: rel(v.numpy() - before[k], ref_updates[k]) for k, v in named_variables(stage.layers).items()}
    result = {"rank": dims.rank, "stage": dims.stage, "replica": dims.replica,
              "blocks": list(stage.plan.stage_names(dims.stage)), "ref_losses": ref_losses, "ref_accs": ref_accs,
              "ref_val_loss": ref_val, "update_err": update_err, **run}
    write_results(hvd, result, args.out)


if __name__ == "__main__":
    main()
