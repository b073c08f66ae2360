"""One rank of the TensorFlow tensor-parallel benchmark: the generated Keras GPT, split over tp ranks.

    horovodrun -np 2 -H localhost:2 --gloo python bench/tf_tp_worker.py --project DIR --tp 2
    horovodrun -np 1 -H localhost:1 --gloo python bench/tf_tp_worker.py --project DIR --tp 1 --threads 2

The Keras side of bench/tp_worker.py, with the same sizes and the same `BENCH {...}` line: builds
the project's model.py (unchanged), splits it with apply_tp (tp 1: unsplit), and times compiled
training steps (forward, the vocabulary-parallel loss, backward, the group's allreduces,
whole-model clipping, AdamW) after warm-up steps, between barriers.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.tp_worker_common import (VOCAB, model_config, parse_args, peak_rss_bytes, print_report,  # noqa: E402
                                    timed_steps)

SPLIT = {"qkv", "proj", "fc", "out", "tokens"}  # the sublayers tensor parallelism splits, of blocks,
# the embedding and the head (a tied head has no `out`: it multiplies by `tokens`)


def variable_bytes(variables) -> int:
    """Bytes of Keras variables, each counted once (a tied head's is the embedding's)."""
    import numpy as np

    held = {id(v): v for v in variables}
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in held.values())


def split_layer_bytes(model) -> int:
    """Bytes of the variables of the layers tensor parallelism splits, split or not."""
    return variable_bytes(v for block in model.layers for name in SPLIT if getattr(block, name, None) is not None
                          for v in getattr(block, name).variables)


def main() -> None:
    args = parse_args()
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_runtime.tf.context import init_horovod
    from hvd_runtime.tf.tensor_parallel import apply_tp
    from hvd_runtime.tf.tensor_state import SlicedVariables
    from hvd_runtime.tf.vocab_parallel import VocabObjective

    sys.path.insert(0, str(args.project))
    from model import build_model

    ctx = init_horovod(seed=0, threads_per_rank=args.threads, tp=args.tp)
    keras.utils.set_random_seed(0)  # one model on every rank and at every tp: the losses of tp 1 and tp 2 must agree
    model = apply_tp(build_model(model_config(args), (args.context,), VOCAB), ctx.tensor.group)
    split = SlicedVariables(model)
    objective = VocabObjective.of(ctx.tensor.group, VOCAB)
    optimizer = keras.optimizers.AdamW(learning_rate=1e-3)
    variables = list(model.trainable_variables)
    optimizer.build(variables)
    model_rss = peak_rss_bytes()
    rng = np.random.default_rng(1)  # every rank of the group reads the same batch
    x = tf.constant(rng.integers(0, VOCAB, (args.batch, args.context)))
    y = tf.constant(rng.integers(0, VOCAB, (args.batch, args.context)))

    @tf.function
    def compiled_step():
        with tf.GradientTape() as tape:
            loss = objective.cross_entropy(y, model(x, training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]  # the embedding's: dense
        factor = tf.minimum(1.0, 1.0 / (split.grad_norm(grads, variables) + 1e-6))
        optimizer.apply_gradients(zip([g * factor for g in grads], variables))
        return loss

    def barrier():  # horovod.tensorflow has no hvd.barrier
        hvd.allreduce(tf.zeros(()), name="bench.barrier")

    times, loss = timed_steps(args, lambda: float(compiled_step()), barrier)
    print_report(hvd, args, times, loss, split_layer_bytes(model),
                 variable_bytes(model.variables), peak_rss_bytes() - model_rss)


if __name__ == "__main__":
    main()
