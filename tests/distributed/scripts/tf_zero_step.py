"""Keras training steps under ZeRO (horovod.zero 1, 2) against the whole model in the same process.

    horovodrun -np 4 --gloo python tf_zero_step.py --cases cases.json
    horovodrun -np 2 --gloo python tf_zero_step.py --cases resume.json     # a case with "resume": DIR

Each case (a JSON object of the flags below, and its own "out") builds the same Keras MLP on every
rank (one seed) and in a reference in the same process. The ZeRO copy trains through the
product's own path (make_optimizer, ZeroSync, TrainStep: clipping by the global norm,
backward_passes_per_step), each rank on its share of the global batch; the reference trains on the
whole global batch with the plain Keras optimizer. After `steps` updates each rank reports the
largest relative error of its variables and of its optimizer slots (its rows of them) against the
reference's, and the share of the optimizer state it holds. "save": DIR writes the checkpoint
after the steps; "resume": DIR restores one instead of training (any stage, any np; zero 0: the
whole optimizer on every rank, rank 0 reading every replica's rows; "saved_np": the saving job's
ranks, whose batches the reference repeats), and reports the errors after it and after one more
step. Rank 0 writes all ranks' reports as JSON.
"""

import argparse
import faulthandler
import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hvd_runtime.tf.context import init_horovod  # noqa: E402

ctx = init_horovod(seed=0, threads_per_rank=1)

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_runtime.checkpoint import TrainState  # noqa: E402
from hvd_runtime.config import CheckpointConfig, HorovodConfig, OptimConfig  # noqa: E402
from hvd_runtime.tf import GradientSync, TrainStep, checkpoint_store, make_optimizer  # noqa: E402
from hvd_runtime.tf.checkpoint import restore_checkpoint, save_checkpoint  # noqa: E402
from hvd_runtime.tf.parallelize import Parallel  # noqa: E402
from hvd_runtime.tf.zero import ZeroSync  # noqa: E402

FEATURES, CLASSES, BATCH = 6, 3, 4
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build():
    keras.utils.set_random_seed(123)   # one model on every rank and in the reference
    # 3 classes: at dp 4 the last layer's rows (its kernel's 16 inputs are rows) are cut, its bias is not
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16), keras.layers.ReLU(),
                             keras.layers.Dense(16), keras.layers.ReLU(), keras.layers.Dense(CLASSES)])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def batches(seed: int, n: int, k: int):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(BATCH * n, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, size=BATCH * n).astype(np.int64)) for _ in range(k)]


class Reference:
    """The whole model in this process, trained on whole global batches (the LR is not scaled by
    the replicas: a checkpoint resumed at another np goes on at the same LR)."""

    def __init__(self, case, optim_cfg):
        self.model = build()
        self.optimizer = make_optimizer(optim_cfg, HorovodConfig(backward_passes_per_step=case["bpps"]), ctx,
                                        steps_per_epoch=4, clip=True)

    def update(self, global_batches):
        k = len(global_batches)
        sums = None
        for x, y in global_batches:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, self.model(x, training=True))
            grads = tape.gradient(loss, self.model.trainable_variables)
            sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
        self.optimizer.apply_gradients(zip([s / k for s in sums], self.model.trainable_variables))


def slots(optimizer, variables) -> dict[int, dict[str, object]]:
    """id(variable) -> {slot name: slot variable}, by Keras's naming after the variable's path."""
    out = {}
    for v in variables:
        prefix = v.path.replace("/", "_") + "_"
        out[id(v)] = {s.name[len(prefix):]: s for s in optimizer.variables if s.name.startswith(prefix)}
    return out


def errors(model, optimizer, zero, reference) -> dict[str, float]:
    """Each variable, and each optimizer slot, against the reference's. Under ZeRO a slot is every
    rank's rows of it gathered (a rank's part may be one element, whose rounding is no measure)
    after checking that this rank's rows are its own part of the whole."""
    out = {}
    ref_vars = reference.model.trainable_variables
    ref_slots = slots(reference.optimizer, ref_vars)
    stepped = zero.applies_to(model.trainable_variables) if zero else model.trainable_variables
    mine = slots(optimizer, stepped)
    for i, (v, s, ref) in enumerate(zip(model.trainable_variables, stepped, ref_vars)):
        out[v.path] = rel(v, ref)
        rows = zero.rows[i] if zero else None
        for slot, value in mine[id(s)].items():
            want = np.asarray(ref_slots[id(ref)][slot])
            if rows is not None:
                assert value.shape[0] == rows[1] - rows[0], (v.path, slot, value.shape, rows)
                value = hvd.allgather(tf.convert_to_tensor(value), name=f"check.{v.path}.{slot}",
                                      process_set=zero.process_set)
            out[f"{v.path}/{slot}"] = rel(value, want)
    return out


def run_case(case):
    n, r, k = ctx.data_size, ctx.data_rank, case["bpps"]
    optim_cfg = OptimConfig(name=case["optim"], lr=0.05, momentum=0.9, clip_norm=case["clip"], weight_decay=0.0,
                            warmup_epochs=0, scale_lr=False)
    reference = Reference(case, optim_cfg)
    model = build()
    # "native": Horovod's reduce-scatter, ZeroSync's path for GPU variables (CPU ones: an all-to-all)
    zero = ZeroSync(model.trainable_variables, case["zero"], ctx.dp_set, r, n,
                    device="GPU:0" if case.get("native") else "CPU:0") if case["zero"] else None
    optimizer = make_optimizer(optim_cfg, HorovodConfig(zero=case["zero"], backward_passes_per_step=k), ctx,
                               steps_per_epoch=4, clip=zero is None)
    step = TrainStep(model, optimizer, loss_fn, zero or GradientSync(), k, clip_norm=case["clip"],
                     grad_norm=zero.grad_norm if zero else None)
    parallel = Parallel(model, optimizer, step, zero=zero)
    report = {"rank": hvd.rank(), "zero": case["zero"]}

    def train(update: int, global_batches):
        for i, (x, y) in enumerate(global_batches):
            step.train_batch(x[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH], i == k - 1, update * k + i)
        reference.update(global_batches)

    if case.get("resume"):
        saved_n = case["saved_np"]   # the reference alone, as the saving job's: the checkpoint holds the rest
        for update in range(case["steps"]):
            reference.update(batches(100 + update, saved_n, k))
        state = restore_checkpoint(checkpoint_store(CheckpointConfig(dir=case["resume"]), ctx), parallel, ctx)
        report["restored_step"] = state.step
        report["restored"] = errors(model, optimizer, zero, reference)
    else:
        for update in range(case["steps"]):
            train(update, batches(100 + update, n, k))
        report["errors"] = errors(model, optimizer, zero, reference)
        if case.get("save"):
            save_checkpoint(checkpoint_store(CheckpointConfig(dir=case["save"]), ctx), parallel,
                            TrainState(step=case["steps"] * k, epoch=0), ctx)
    train(case["steps"], batches(200, n, k))   # one more: this job's batches, the optimizer state as it stands
    report["after_one_more"] = errors(model, optimizer, zero, reference)
    if zero is not None:
        held = sum(int(np.prod(s.shape)) for s in optimizer.variables if len(s.shape) > 0)
        whole = sum(int(np.prod(s.shape)) for s in reference.optimizer.variables if len(s.shape) > 0)
        report["optimizer_share"] = held / whole
    return report


def main():
    faulthandler.dump_traceback_later(240, exit=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="a JSON list of cases (see the module's docstring)")
    args = ap.parse_args()
    defaults = {"optim": "sgd", "clip": 0.0, "bpps": 1, "steps": 2}
    for case in json.loads(Path(args.cases).read_text()):
        case = {**defaults, **case}
        reports = hvd.allgather_object(run_case(case), name=f"reports.{case['out']}")
        if hvd.rank() == 0:
            Path(case["out"]).write_text(json.dumps(reports))


if __name__ == "__main__":
    main()
