"""One rank of the TensorFlow tensor-parallel benchmark: the generated Keras GPT, split over tp ranks.

    horovodrun -np 2 -H localhost:2 --gloo python bench/tf_tp_worker.py --project DIR --tp 2
    horovodrun -np 1 -H localhost:1 --gloo python bench/tf_tp_worker.py --project DIR --tp 1 --threads 2

The Keras side of bench/tp_worker.py, with the same sizes and the same `BENCH {...}` line: builds
the project's model.py (unchanged), splits it with apply_tp (tp 1: unsplit), and times compiled
training steps (forward, the vocabulary-parallel loss, backward, the group's allreduces,
whole-model clipping, AdamW) after warm-up steps, between barriers.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPLIT = {"qkv", "proj", "fc", "out", "tokens"}  # the sublayers tensor parallelism splits, of blocks,
# the embedding and the head (a tied head has no `out`: it multiplies by `tokens`)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def split_layer_bytes(model) -> int:
    """Bytes of the variables of the layers tensor parallelism splits, split or not (each counted once)."""
    held = {id(v): v for block in model.layers for name in SPLIT if hasattr(block, name)
            and getattr(block, name) is not None for v in getattr(block, name).variables}
    return sum(v.shape.num_elements() * v.dtype.size for v in held.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_runtime.config import ModelConfig
    from hvd_runtime.tf.context import init_horovod
    from hvd_runtime.tf.tensor_parallel import apply_tp
    from hvd_runtime.tf.tensor_state import SplitVariables
    from hvd_runtime.tf.vocab_parallel import VocabObjective

    sys.path.insert(0, str(args.project))
    from model import build_model

    ctx = init_horovod(seed=0, threads_per_rank=args.threads, tp=args.tp)
    vocab = 256
    cfg = ModelConfig(width=args.width, layers=args.layers, heads=args.heads, context=args.context, dropout=0.0,
                      tie_embeddings=True)
    keras.utils.set_random_seed(0)  # one model on every rank and at every tp: the losses of tp 1 and tp 2 must agree
    model = apply_tp(build_model(cfg, (args.context,), vocab), ctx.tensor.group)
    split = SplitVariables(model)
    objective = VocabObjective.of(ctx.tensor.group, vocab)
    optimizer = keras.optimizers.AdamW(learning_rate=1e-3)
    variables = list(model.trainable_variables)
    optimizer.build(variables)
    model_rss = peak_rss_bytes()
    rng = np.random.default_rng(1)  # every rank of the group reads the same batch
    x = tf.constant(rng.integers(0, vocab, (args.batch, args.context)))
    y = tf.constant(rng.integers(0, vocab, (args.batch, args.context)))

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = objective.cross_entropy(y, model(x, training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]  # the embedding's: dense
        factor = tf.minimum(1.0, 1.0 / (split.grad_norm(grads, variables) + 1e-6))
        optimizer.apply_gradients(zip([g * factor for g in grads], variables))
        return loss

    def barrier():
        hvd.allreduce(tf.zeros(()), name="bench.barrier")

    times = []
    for step in range(args.warmup + args.steps):
        barrier()
        started = time.perf_counter()
        loss = float(train_step())
        barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    report = {"tp": args.tp, "ranks": hvd.size(), "threads": args.threads,
              "step_ms": 1000 * statistics.median(times), "loss": loss,
              "split_layer_bytes": split_layer_bytes(model),
              "param_bytes": sum(v.shape.num_elements() * v.dtype.size for v in model.variables),
              "training_rss_rise_bytes": peak_rss_bytes() - model_rss}
    reports = hvd.allgather_object(report)
    if hvd.rank() == 0:
        print("BENCH " + json.dumps(reports), flush=True)


if __name__ == "__main__":
    main()
