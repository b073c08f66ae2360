"""One rank of the TensorFlow workload benchmark: ResNet-18 or GPT from a generated Keras project, in one of three loops.

    horovodrun -np 2 -H localhost:2 --gloo python bench/tf_workload_worker.py --loop ours --model gpt --project DIR --data DIR
    horovodrun -np 2 -H localhost:2 --gloo python bench/tf_workload_worker.py --loop reference ...
    TF_CONFIG='{"cluster": {"worker": [...]}, "task": {...}}' python bench/tf_workload_worker.py --loop mwms ...

`ours` is the generated project's loop (hvd_runtime.tf: ShardedBatches, parallelize's TrainStep,
hvd_runtime.loop.train_epoch), started as train.py starts it. `reference` is written as Horovod's
Keras example is: `horovod.tensorflow.keras`, hvd.DistributedOptimizer around a Keras optimizer,
`model.fit` with Horovod's broadcast and metric-averaging callbacks (under Keras 3 it averages
only in the Horovod that `hvdgen install-horovod` builds). `mwms` is TensorFlow's own answer,
tf.distribute's MultiWorkerMirroredStrategy, in the custom loop of TensorFlow's multi-worker tutorial
(`strategy.run` in a tf.function, per-worker input from `distribute_datasets_from_function`):
Keras 3's `model.fit` fails under that strategy with more than one worker (its symbolic build
reduces a batch of integer labels across workers), so a Keras 3 user writes this loop.

All three train the same model (the project's model.py) with the same SGD (momentum 0.9, learning
rate 0.01 x workers), on the same files read from disk by the same reader (the split's `take` in
tf.data's parallel map), with the same per-rank batch, one thread per rank and no loader worker
processes. The other two loops read one repeated dataset through one iterator, as they are
written, with tf.data's autotuning on as users leave it (ours turns it off: hvd_runtime.tf.batches).
An epoch warms up, the next is timed between barriers; rank 0 prints one `BENCH {...}` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LR = 0.01
MODEL_OVERRIDES = {"resnet18": ["model.width=16"], "gpt": []}  # the torch benchmark's sizes (GPT: the project's)


def load(args):
    """The project's config (with the benchmark's optimizer and sizes) and its dataset."""
    from hvd_runtime.config import load_config
    from hvd_runtime.data import load_image_folder, load_npz, load_tokens

    sys.path.insert(0, str(Path(args.project).resolve()))
    cfg = load_config(Path(args.project) / "config.yaml", MODEL_OVERRIDES[args.model] + [
        f"train.batch_size={args.batch_size}", "optim.name=sgd", f"optim.lr={LR}", "optim.momentum=0.9",
        "optim.weight_decay=0", "optim.warmup_epochs=0", "optim.clip_norm=0", "optim.scale_lr=true",
        "tracking.enabled=false"])
    if args.model == "gpt":
        dataset = load_tokens(args.data, context=cfg.model.context)
    elif args.data.endswith(".npz"):  # images held in memory: the loop's speed, not the decoder's
        dataset = load_npz(args.data, val_fraction=0.05)
    else:
        dataset = load_image_folder(args.data, image_size=32, val_fraction=0.05)
    return cfg, dataset


def build(cfg, dataset):
    import keras
    from model import build_model

    keras.utils.set_random_seed(0)
    return build_model(cfg.model, dataset.input_shape, dataset.num_classes)


def one_thread() -> None:
    """One TensorFlow thread, as ours runs (hvd_runtime.tf.context.pin_devices, on a CPU host)."""
    from hvd_runtime.tf.context import pin_devices

    pin_devices(local_rank=0, local_size=1, threads_per_rank=1)


def read_batches(split, batch_size: int, shard: int, shards: int, seed: int = 0):
    """This worker's batches of the split, read from disk in tf.data's parallel map (as ours does)."""
    import tensorflow as tf

    from hvd_runtime.tf.batches import split_reader

    indices = tf.data.Dataset.range(len(split)).shuffle(len(split), seed=seed).shard(shards, shard)
    batches = indices.batch(batch_size, drop_remainder=True)
    return batches.map(split_reader(split), num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def run_ours(cfg, dataset, args) -> tuple[float, int, int]:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvd_runtime.loop import train_epoch
    from hvd_runtime.tf import ShardedBatches, init_horovod, restore_checkpoint
    from hvd_runtime.tf.parallelize import parallelize

    ctx = init_horovod(cfg.seed, 1, cfg.horovod.cycle_time_ms)
    batches = ShardedBatches(dataset.train, cfg.train.batch_size, ctx.data_rank, ctx.data_size, seed=cfg.seed)
    parallel = parallelize(build(cfg, dataset), ctx, cfg, dataset, steps_per_epoch=len(batches))
    state = restore_checkpoint(None, parallel, ctx, resume=False)  # rank 0's weights
    train_epoch(parallel.step, batches, state, is_root=ctx.is_root)  # warm-up (and tracing)
    barrier = lambda: hvd.allreduce(tf.zeros(()), name="bench.barrier")  # noqa: E731
    barrier()
    started = time.perf_counter()
    train_epoch(parallel.step, batches, state, is_root=ctx.is_root)
    barrier()
    return time.perf_counter() - started, len(batches) * batches.samples_per_step, hvd.rank()


def run_reference(cfg, dataset, args) -> tuple[float, int, int]:
    import horovod.tensorflow.keras as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    one_thread()
    model = build(cfg, dataset)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR * hvd.size(), momentum=0.9))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer,
                  metrics=["accuracy"])
    batches = read_batches(dataset.train, args.batch_size, hvd.rank(), hvd.size())
    steps = len(dataset.train) // hvd.size() // args.batch_size

    class Timed(keras.callbacks.Callback):
        """The second epoch's wall time, between barriers, inside model.fit's own loop."""

        seconds = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                hvd.allreduce(tf.zeros(()), name="bench.barrier")
                self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                hvd.allreduce(tf.zeros(()), name="bench.barrier")
                self.seconds = time.perf_counter() - self.started

    timed = Timed()
    model.fit(batches.repeat(), steps_per_epoch=steps, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                         timed])
    return timed.seconds, steps * args.batch_size * hvd.size(), hvd.rank()


def run_mwms(cfg, dataset, args) -> tuple[float, int, int]:
    import keras
    import tensorflow as tf

    one_thread()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    global_batch = args.batch_size * workers
    batches = strategy.distribute_datasets_from_function(
        lambda ctx: read_batches(dataset.train, ctx.get_per_replica_batch_size(global_batch),
                                 ctx.input_pipeline_id, ctx.num_input_pipelines).repeat())
    iterator = iter(batches)  # one for every epoch, as the tutorial's loop has it
    with strategy.scope():
        model = build(cfg, dataset)
        optimizer = keras.optimizers.SGD(LR * workers, momentum=0.9)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_sample = tf.reshape(per_example(y, logits), (tf.shape(y)[0], -1))  # GPT: per token
            loss = tf.nn.compute_average_loss(tf.reduce_mean(per_sample, axis=1), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(y, logits)
        return loss

    @tf.function
    def train_step(iterator):
        return strategy.reduce("SUM", strategy.run(step, args=next(iterator)), axis=None)

    steps = len(dataset.train) // workers // args.batch_size

    def epoch() -> None:
        for _ in range(steps):
            train_step(iterator)

    @tf.function
    def all_workers():
        return strategy.reduce("SUM", strategy.run(lambda: tf.ones(())), axis=None)

    epoch()  # warm-up (and tracing)
    all_workers()
    started = time.perf_counter()
    epoch()
    all_workers()
    return time.perf_counter() - started, steps * global_batch, rank


LOOPS = {"ours": run_ours, "reference": run_reference, "mwms": run_mwms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", choices=sorted(LOOPS), required=True)
    parser.add_argument("--model", choices=sorted(MODEL_OVERRIDES), required=True)
    parser.add_argument("--project", required=True, help="a TensorFlow project generated with that --model")
    parser.add_argument("--data", required=True, help="an image folder (resnet18) or a token folder (gpt)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    from hvd_runtime.tf.lean_import import import_tensorflow

    import_tensorflow()
    cfg, dataset = load(args)
    seconds, samples, rank = LOOPS[args.loop](cfg, dataset, args)
    if rank == 0:
        per_sample = cfg.model.context if args.model == "gpt" else 1
        print("BENCH " + json.dumps({"loop": args.loop, "model": args.model, "seconds": seconds,
                                     "samples_per_s": samples / seconds,
                                     "items_per_s": samples * per_sample / seconds}), flush=True)


if __name__ == "__main__":
    main()
