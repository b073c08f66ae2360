"""One gradient of the generated Keras GPT split by tensor parallelism, against the unsplit GPT in the same process.

    horovodrun -np 2 --gloo python tf_tp_step.py --tp 2 --project DIR --out r.json     # tp=2
    horovodrun -np 4 --gloo python tf_tp_step.py --tp 2 --project DIR --out r.json     # tp=2 x dp=2
    horovodrun -np 4 --gloo python tf_tp_step.py --tp 2 --project DIR --vocab 17 --tied --out r.json

The TensorFlow counterpart of tp_step.py: every rank builds the GPT of a generated project
(`hvdgen new --framework tensorflow --model gpt`) and takes the whole global batch's gradient as
the reference; `apply_tp` splits it (blocks, and the embedding and head by vocabulary: its
logits are this rank's vocabulary rows, trained with hvd_runtime.tf.vocab_parallel's loss), the
rank takes its data-parallel replica's share of the batch, and Horovod averages gradients over the
replicas. Each rank reports the relative error of its logits, loss, accuracy and every variable's
gradient against the matching slice of the reference; rank 0 writes all ranks' reports as JSON.
"""

import argparse

import hvd_runtime.tf  # noqa: F401  first, as a generated train.py: TensorFlow without Keras' unused extras
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvd_runtime.parallel.tensor_groups import init_tensor_parallel
from hvd_runtime.tf.objective import accuracy_sum
from hvd_runtime.tf.tensor_parallel import ColumnParallelDense, RowParallelDense, VocabParallelEmbedding, apply_tp
from hvd_runtime.tf.vocab_parallel import VocabObjective

from step_driver import write_results
from tf_workloads import load_workload

BATCH = 8


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def gradients(model: keras.Model, x, y, loss_fn, accuracy_fn):
    """The logits, loss, number right and each trainable variable's gradient of the loss, by variable id."""
    with tf.GradientTape() as tape:
        logits = model(x)
        loss = loss_fn(y, logits)
    grads = tape.gradient(loss, model.trainable_variables)  # an embedding's come as IndexedSlices: made dense
    return (logits.numpy(), float(loss), float(accuracy_fn(logits, y)),
            {id(v): tf.convert_to_tensor(g) for v, g in zip(model.trainable_variables, grads)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--project", required=True)
    ap.add_argument("--vocab", type=int, default=16, help="the vocabulary size")
    ap.add_argument("--tied", action="store_true", help="the head tied to the token embedding")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    ranks = init_tensor_parallel(hvd, args.tp)
    layout, group, dp_set, rank = ranks.dims, ranks.group, ranks.dp_set, hvd.rank()

    workload = load_workload("gpt", args.project, None, None, None, vocab=args.vocab, tied=args.tied)
    model = workload.build()
    x, y = workload.batch(np.random.default_rng(11), BATCH)
    plain = VocabObjective.of(None, args.vocab)
    ref_logits, _, _, ref_grads = gradients(model, x, y, plain.cross_entropy, plain.accuracy_sum)
    share = slice(rank // layout.tp * BATCH // layout.dp, (rank // layout.tp + 1) * BATCH // layout.dp)
    ref_loss = float(plain.cross_entropy(y[share], ref_logits[share]))
    ref_correct = float(accuracy_sum(ref_logits[share], y[share]))

    split = apply_tp(model, group)  # shares the position embedding and norms with the reference
    objective = VocabObjective.of(group, args.vocab)
    logits, loss, correct, grads = gradients(split, x[share], y[share], objective.cross_entropy,
                                             objective.accuracy_sum)
    if dp_set is not None:  # the replicas' mean: the gradient of the global batch's mean
        grads = {k: hvd.allreduce(g, op=hvd.Average, process_set=dp_set) for k, g in grads.items()}

    rows = split.layers[-1].tokens.source_index if args.tied else split.layers[-1].out.source_index
    errors = {"logits": rel(logits, ref_logits[share][..., rows]), "loss": rel(loss, ref_loss),
              "accuracy": rel(correct, ref_correct) if ref_correct else float(correct != 0)}
    compared = set()
    for layer in split._flatten_layers(include_self=False):
        if isinstance(layer, VocabParallelEmbedding):
            source = model.layers[0].tokens.embeddings
            want = np.take(tf.convert_to_tensor(ref_grads[id(source)]), layer.source_index, axis=0)
            errors[f"{layer.name}.embeddings"] = rel(grads[id(layer.embeddings)], want)
            compared.add(id(source))
        for name, var in (("kernel", getattr(layer, "kernel", None)), ("bias", getattr(layer, "bias", None))):
            if var is None or not isinstance(layer, (ColumnParallelDense, RowParallelDense)):
                continue
            want = ref_grads[id(getattr(layer.source, name))]
            if isinstance(layer, ColumnParallelDense):
                want = np.take(want, layer.source_index, axis=-1)
            elif name == "kernel":
                want = np.take(want, layer.source_index, axis=0)
            errors[f"{layer.name}.{name}"] = rel(grads[id(var)], want)
            compared.add(id(getattr(layer.source, name)))
    for var in split.trainable_variables:  # what stays whole is the reference's own variable
        if id(var) in ref_grads:
            errors[var.path] = rel(grads[id(var)], ref_grads[id(var)])
            compared.add(id(var))
    share_held = [(int(np.prod(layer.kernel.shape)), int(np.prod(layer.source.kernel.shape)))
                  for layer in split._flatten_layers(include_self=False)
                  if isinstance(layer, (ColumnParallelDense, RowParallelDense))]
    share_held += [(int(np.prod(layer.embeddings.shape)), args.vocab * layer.embeddings.shape[1])
                   for layer in split._flatten_layers(include_self=False) if isinstance(layer, VocabParallelEmbedding)]
    report = {"rank": rank, "tp_rank": group.rank, "errors": errors,
              "split_share": sum(h for h, _ in share_held) / sum(w for _, w in share_held),
              "uncompared": sorted(v.path for v in model.trainable_variables if id(v) not in compared)}
    write_results(hvd, report, args.out)


if __name__ == "__main__":
    main()
