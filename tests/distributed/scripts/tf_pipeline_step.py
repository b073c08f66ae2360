"""TensorFlow: train a few steps with the pipeline and, in the same process, with the whole model.

    horovodrun -np 2 --gloo python tf_pipeline_step.py --stages 2 --schedule 1f1b --micro-batches 4 --out r.json

Every rank computes the single-process reference itself (the whole global batch through the
whole model, plain SGD) and compares its own stage's variables after the steps, and the reported
losses and accuracies, with it. Replicas other than 0 build their copy from another seed, so
the engine's start-up broadcast is what makes them agree. Rank 0 writes all results as JSON
(the format tests/helpers/pipeline_checks.py judges). `--model resnet18|gpt --project DIR` splits a
generated project's model instead of the MLP here (for BatchNorm, the reference sees the same
micro-batches one after the other); `--clip-norm` clips by the whole model's norm. `--tp N` splits
each stage's transformer blocks over N ranks (slice_stage); the ranks of a tp group build from
different seeds too, so slice_stage's start-up broadcast is checked as well, and each slice's
update is compared with its slice of the reference's.
"""

import hvd_runtime.tf  # noqa: F401  first, as a generated train.py: TensorFlow without Keras' unused extras
import keras
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_runtime.tf.objective import accuracy_sum
from hvd_runtime.tf.pipeline import PipelineEngine, build_stage, init_pipeline, slice_stage
from hvd_runtime.tf.recompute import recompute_blocks
from hvd_runtime.tf.vocab_parallel import VocabObjective
from hvd_runtime.tf.tensor_state import SlicedVariables

from step_driver import drive_pipeline, each_case, parse_args, write_results
from tf_workloads import VOCAB, load_workload

FEATURES, CLASSES, WIDTH = 16, 5, 32
BLOCKS = [f"b{i}" for i in range(7)]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(seed: int = 1234, flatten_first: bool = False, regularize: bool = False) -> keras.Sequential:
    """Seven blocks: Dense and tanh in turn, named b0..b6; with flatten_first, a weight-free
    Flatten named "flat" before them (a stage may hold only it); with regularize, each Dense's
    kernel has an L2 penalty, which Keras adds to the loss."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((FEATURES,)), *([keras.layers.Flatten(name="flat")] if flatten_first else [])]
    for i in range(7):
        if i % 2:
            layers.append(keras.layers.Activation("tanh", name=f"b{i}"))
        else:
            layers.append(keras.layers.Dense(CLASSES if i == 6 else WIDTH, name=f"b{i}",
                                             kernel_regularizer=keras.regularizers.L2(0.05) if regularize else None))
    return keras.Sequential(layers)


def named_variables(layers, trainable_only: bool = False) -> dict:
    """'b2/kernel' -> float variable: its path below the model's name, the same in any model built the same way."""
    return {v.path.split("/", 1)[1]: v for layer in layers
            for v in (layer.trainable_variables if trainable_only else layer.variables) if "float" in str(v.dtype)}


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def mlp_batch(rng, n):
    return rng.standard_normal((n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n)


def sized_chunks(x, y, parts: int) -> list:
    """(x, y, share of the batch) in `parts` pieces, sized as the pipeline cuts micro-batches."""
    n = len(y)
    sizes = [n // parts + (i < n % parts) for i in range(min(parts, n))]
    bounds = np.cumsum([0, *sizes])
    return [(x[a:b], y[a:b], (b - a) / n) for a, b in zip(bounds[:-1], bounds[1:])]


def reference(xs, ys, x_val, y_val, flatten_first: bool = False, work=None, pieces=None, clip_norm: float = 0.0,
              lr: float = 0.5, trainable_only: bool = False):
    """The whole model trained in this process: losses, accuracies, val loss, updates, whether clipping acted.

    `pieces(x, y)` gives (x, y, weight) parts whose weighted losses add up to the batch's mean
    loss (a model with BatchNorm must see the micro-batches the split model sees); default: whole.
    """
    ref = work.build(1234) if work is not None else make_model(flatten_first=flatten_first)
    before = {k: v.numpy().copy() for k, v in named_variables(ref.layers, trainable_only).items()}
    opt = keras.optimizers.SGD(lr, global_clipnorm=clip_norm or None)
    losses, accs, clipped = [], [], []
    for x, y in zip(xs, ys):
        parts = pieces(x, y) if pieces is not None else [(x, y, 1.0)]
        with tf.GradientTape() as tape:
            outs = [ref(xc, training=True) for xc, _, _ in parts]
            loss = tf.add_n([LOSS(yc, out) * w for (_, yc, w), out in zip(parts, outs)])
            if ref.losses:   # kernel regularizers, as model.fit adds them: once a step
                loss = loss + tf.add_n(ref.losses)
        # dense, as the allreduce makes them: an embedding's IndexedSlices repeat a token's row, and a
        # global norm taken over those rows would count it once per occurrence
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, ref.trainable_variables)]
        clipped.append(bool(clip_norm) and float(tf.linalg.global_norm(grads)) > clip_norm)
        opt.apply_gradients(zip(grads, ref.trainable_variables))
        losses.append(float(loss))
        accs.append(sum(float(accuracy_sum(out, yc)) for (_, yc, _), out in zip(parts, outs)) / len(y))
    updates = {k: v.numpy() - before[k] for k, v in named_variables(ref.layers, trainable_only).items()}
    return losses, accs, float(LOSS(y_val, ref(x_val, training=False))), updates, clipped


def main():
    from p2p_links_tf import links   # bench/: the links other than the socket link (helpers.bench_links)

    args = parse_args(pipeline=True, p2p="socket", cases=True)
    _, place = init_pipeline(stages=args.stages, threads_per_rank=1, tp=args.tp, chunks=args.chunks,
                             links=links(args.p2p))
    for case_args in each_case(args):
        write_results(hvd, run_case(case_args, place), case_args.out)


def run_case(args, place) -> dict:
    """Train args.steps steps with this rank's stage and with the whole model; return what to compare."""
    work = load_workload(args.model, args.project,
                         lambda seed=1234: make_model(seed, args.flatten_first, args.regularize), mlp_batch,
                         (["flat"] if args.flatten_first else []) + BLOCKS)
    tp_rank = place.tensor_group.rank if place.tensor_group else 0
    rng = np.random.default_rng(7)
    global_batch = args.batch * place.replicas
    batches = [work.batch(rng, global_batch) for _ in range(args.steps)]
    xs, ys = [b[0] for b in batches], [b[1] for b in batches]
    x_val, y_val = work.batch(rng, 3 * global_batch)
    pieces = (lambda x, y: sized_chunks(x, y, args.micro_batches)) if work.batch_norm else None
    ref_losses, ref_accs, ref_val, ref_updates, clipped = reference(xs, ys, x_val, y_val, work=work, pieces=pieces,
                                                                    clip_norm=args.clip_norm, lr=args.lr)

    model = work.build(1234 + 1000 * place.replica + 100 * tp_rank)  # replica 0's, tp rank 0's must win
    stage = build_stage(model, place, partition=args.partition, sample=xs[0][:args.batch])
    before = {k: v.numpy().copy() for k, v in named_variables(stage.layers).items()}
    names = list(before)  # the unsplit stage's float variables, in order: a split stage's line up with them
    if args.tp > 1:
        stage = slice_stage(stage, place)
    if args.recompute:  # each micro-batch's blocks run again in its backward
        recompute_blocks(stage)
    # the last stage's logits are split over the vocabulary at tp > 1: its loss and accuracy sum over the group
    objective = VocabObjective.of(place.tensor_group, VOCAB)
    engine = PipelineEngine(stage, place, objective.cross_entropy, keras.optimizers.SGD(args.lr), schedule=args.schedule,
                            micro_batches=args.micro_batches, metrics_fn=objective.accuracy,
                            timeline=args.run_dir is not None,
                            clip_norm=args.clip_norm)
    if place.replica or tp_rank:
        # what replica 0's tp rank 0 started from: broadcast over the tp group, then the stage's replicas
        start = named_variables(work.build(1234).layers)
        before = {k: start[k].numpy().copy() for k in before}
    run = drive_pipeline(engine, place, xs, ys, x_val, y_val, args)

    splits = SlicedVariables(stage).by_id  # tensor parallelism: this rank holds a slice of these
    held = [v for layer in stage.layers for v in layer.variables if "float" in str(v.dtype)]
    assert len(held) == len(names), (len(held), len(names))

    def part(v, array):
        """The part of a reference array this rank's stage holds."""
        split = splits.get(id(v))
        return array if split is None else np.take(array, split.index, axis=split.axis)

    update_err = {k: rel(v.numpy() - part(v, before[k]), part(v, ref_updates[k])) for k, v in zip(names, held)}
    split_names = sorted(k for k, v in zip(names, held) if id(v) in splits)
    result = {"rank": place.rank, "stage": place.stage, "replica": place.replica, "tp_rank": tp_rank,
              "sliced_params": split_names,
              "blocks": list(stage.plan.stage_names(place.stage)),
              "chunk_blocks": [[layer.name for layer in stage.chunk_layers(c)] for c in range(place.chunks)], "ref_losses": ref_losses, "ref_accs": ref_accs,
              "ref_val_loss": ref_val, "update_err": update_err, "clipped": clipped, **run}
    return result


if __name__ == "__main__":
    main()
