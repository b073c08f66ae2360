"""Numerical checks of hvd_runtime.tf's data parallelism, run under horovodrun -np 2.

Each check compares what the ranks do together against one process doing the same work on the
global batch (computed here, in every rank, with plain Keras), and prints `OK <name>` on rank 0
when it holds on every rank.
"""

import checks  # beside this script: report()
import os
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

from hvd_runtime.tf.context import init_horovod  # noqa: E402

ctx = init_horovod(seed=0, threads_per_rank=1)

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_runtime.checkpoint import CheckpointStore  # noqa: E402
from hvd_runtime.config import HorovodConfig, OptimConfig  # noqa: E402
from hvd_runtime.data import Split  # noqa: E402
from hvd_runtime.loop import Every, means_over_ranks, train_epoch  # noqa: E402
from hvd_runtime.nonfinite import Guard, NonFinite  # noqa: E402
from hvd_runtime.tf.step import sum_over_ranks  # noqa: E402
from keras_fit import AverageMetrics, BroadcastVariables, distribute_fit  # noqa: E402
from hvd_runtime.tf import (GradientSync, ShardedBatches, SyncBatchNormalization, TrainStep,  # noqa: E402
                            checkpoint_store, make_optimizer, restore_checkpoint,
                            save_checkpoint, use_sync_batchnorm)
from hvd_runtime.config import CheckpointConfig  # noqa: E402
from hvd_runtime.tf.parallelize import Parallel  # noqa: E402
from hvd_runtime.tf.recompute import recompute_blocks  # noqa: E402
from hvd_runtime.config import ConfigError  # noqa: E402

assert ctx.size == 2, "run with -np 2"
R = ctx.rank
TOL = 1e-5
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(7)
X = rng.normal(size=(16, 6)).astype(np.float32)
Y = rng.integers(0, 3, size=16).astype(np.int64)


def halves(a):
    return np.split(a, 2)[R]


def model_fn(batch_norm=False, seed=123):
    keras.utils.set_random_seed(seed)  # identical init on every rank and in the reference
    layers = [keras.Input((6,)), keras.layers.Dense(8)]
    layers += [keras.layers.BatchNormalization()] if batch_norm else []
    layers += [keras.layers.ReLU(), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def max_rel_diff(a_vars, b_vars) -> float:
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-12))
               for a, b in zip(a_vars, b_vars))


def same_on_all_ranks(variables, name) -> bool:
    mine = np.concatenate([np.asarray(v).ravel() for v in variables])
    everyone = hvd.allgather_object(mine, name=name)
    return all(np.array_equal(everyone[0], other) for other in everyone[1:])


def report(name: str, ok: bool, detail: str = "") -> None:
    checks.report(hvd, name, ok, detail)


def reference_sgd(model, batches, lr, momentum):
    """Plain Keras on one process: each batch is the global batch of one step."""
    opt = keras.optimizers.SGD(lr, momentum=momentum)
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model


# 1. Five momentum-SGD steps on different halves per rank == five plain steps on the whole batches.
#    This is what a wrapper that silently never averages (Keras 3 model.fit + DistributedOptimizer) fails.
steps = [(np.roll(X, 3 * s, axis=0), np.roll(Y, 3 * s)) for s in range(5)]
reference = reference_sgd(model_fn(), steps, lr=0.1, momentum=0.9)
model = model_fn()
sgd = OptimConfig(name="sgd", lr=0.1, momentum=0.9, scale_lr=False, warmup_epochs=0)
opt = make_optimizer(sgd, HorovodConfig(), ctx, steps_per_epoch=5)
step = TrainStep(model, opt, loss_fn, GradientSync())
for x, y in steps:
    step(halves(x), halves(y))
diff = max_rel_diff(model.variables, reference.variables)
report("steps_match_global_batch_reference", diff < TOL, f"max rel diff {diff:.2e}")
report("ranks_identical_after_training", same_on_all_ranks(model.variables, "w1"))

# 2. backward_passes_per_step=2: two local quarters, one allreduce == one step on the whole batch.
reference = reference_sgd(model_fn(), [(X, Y)], lr=0.1, momentum=0.0)
model = model_fn()
plain = OptimConfig(name="sgd", lr=0.1, momentum=0.0, scale_lr=False, warmup_epochs=0)
step = TrainStep(model, make_optimizer(plain, HorovodConfig(), ctx, 1), loss_fn, GradientSync(),
                 backward_passes_per_step=2)
qx, qy = np.split(X, 4), np.split(Y, 4)
step(qx[2 * R], qy[2 * R], apply=False)
moved = max_rel_diff(model.variables, model_fn().variables)
step(qx[2 * R + 1], qy[2 * R + 1], apply=True)
diff = max_rel_diff(model.variables, reference.variables)
report("backward_passes_per_step_accumulates", diff < TOL and moved == 0.0,
       f"max rel diff {diff:.2e}, moved before apply {moved:.1e}")

# 3. fp16 compression: the same step, to fp16 precision, and the allreduce really went through fp16.
model = model_fn()
sync = GradientSync(fp16_compression=True)
step = TrainStep(model, make_optimizer(plain, HorovodConfig(), ctx, 1), loss_fn, sync)
step(halves(X), halves(Y))
diff = max_rel_diff(model.variables, reference.variables)
probe = tf.constant([1.0 + 2.0 ** -12], tf.float32)  # not representable in fp16: rounds to 1.0
rounded = sync([probe], [tf.Variable(probe)])[0].numpy()[0]
report("fp16_compression_close", diff < 1e-2 and rounded == 1.0, f"max rel diff {diff:.2e}")

# 4. SyncBatchNormalization: each rank's output equals BatchNorm over the global batch, sliced;
#    after one step the weights and the moving statistics equal the global-batch reference.
reference = model_fn(batch_norm=True)
expected = reference(X, training=True).numpy()
synced = use_sync_batchnorm(model_fn(batch_norm=True))
assert isinstance(synced.layers[1], SyncBatchNormalization)
got = synced(halves(X), training=True).numpy()
diff = float(np.abs(got - halves(expected)).max() / np.abs(expected).max())
report("sync_batchnorm_uses_global_statistics", diff < TOL, f"max rel diff {diff:.2e}")
reference = reference_sgd(model_fn(batch_norm=True), [(X, Y)], lr=0.1, momentum=0.0)
synced = use_sync_batchnorm(model_fn(batch_norm=True))
TrainStep(synced, make_optimizer(plain, HorovodConfig(), ctx, 1), loss_fn, GradientSync())(halves(X), halves(Y))
# (The bias before a BatchNorm has a gradient of ~0 and stays at its initial 0: compare with a floor.)
diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
           for a, b in zip(synced.trainable_variables, reference.trainable_variables))
report("sync_batchnorm_step_matches_global_batch", diff < 1e-5, f"max abs diff {diff:.2e}")
stats = max_rel_diff(synced.non_trainable_variables, reference.non_trainable_variables)
report("sync_batchnorm_moving_stats_match", stats < TOL, f"max rel diff {stats:.2e}")


# 5. Local variables: a per-rank head is trained on this rank's gradient alone, while the shared
#    body is averaged. Reference: the same arithmetic for both ranks in one process.
def body_head(seed=5):
    keras.utils.set_random_seed(seed)
    body = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh")])
    head = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    return body, head


ref_body, ref_head0 = body_head()
_, ref_head1 = body_head()
ref_heads = [ref_head0, ref_head1]
lr = 0.2
for x, y in steps[:3]:
    xs, ys = np.split(x, 2), np.split(y, 2)
    with tf.GradientTape(persistent=True) as tape:
        losses = [loss_fn(ys[r], ref_heads[r](ref_body(xs[r]))) for r in range(2)]
        mean_loss = (losses[0] + losses[1]) / 2
    body_grads = tape.gradient(mean_loss, ref_body.trainable_variables)
    head_grads = [tape.gradient(losses[r], ref_heads[r].trainable_variables) for r in range(2)]
    for v, g in zip(ref_body.trainable_variables, body_grads):
        v.assign_sub(lr * g)
    for r in range(2):
        for v, g in zip(ref_heads[r].trainable_variables, head_grads[r]):
            v.assign_sub(lr * g)
    del tape

body, head = body_head()
model = keras.Sequential([body, head])
sync = GradientSync(local_variables=head.trainable_variables)
step = TrainStep(model, keras.optimizers.SGD(lr), loss_fn, sync)
for x, y in steps[:3]:
    step(halves(x), halves(y))
body_diff = max_rel_diff(body.variables, ref_body.variables)
head_diff = max_rel_diff(head.variables, ref_heads[R].variables)
report("local_variables_not_allreduced", body_diff < TOL and head_diff < TOL,
       f"body {body_diff:.2e}, head {head_diff:.2e}")
report("local_variables_differ_shared_identical",
       same_on_all_ranks(body.variables, "body") and not same_on_all_ranks(head.variables, "head"))


# 6. Model parallelism: the first Dense layer split by output columns, one shard per rank, its
#    outputs gathered with hvd.allgather; the rest of the model is replicated. Every rank sees the
#    same batch. Shards are local variables (their gradient comes back through the allgather); one
#    step must equal one step of the whole model in one process.
class ColumnShard(keras.layers.Layer):
    """This rank's columns of a wider Dense layer; the full output is gathered from all ranks."""

    def __init__(self, kernel, bias, **kwargs):
        super().__init__(**kwargs)
        self.kernel = self.add_weight(shape=kernel.shape, initializer=keras.initializers.Constant(kernel))
        self.bias = self.add_weight(shape=bias.shape, initializer=keras.initializers.Constant(bias))

    def call(self, x):
        part = tf.matmul(x, self.kernel) + self.bias          # (batch, columns of this rank)
        return tf.transpose(hvd.allgather(tf.transpose(part), name=f"{self.name}.gather"))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.kernel.shape[1] * hvd.size())


keras.utils.set_random_seed(11)
full = keras.layers.Dense(8, activation="tanh")
reference = keras.Sequential([keras.Input((6,)), full, keras.layers.Dense(3)])
kernel, bias = (np.asarray(v) for v in full.variables)
shard = ColumnShard(np.split(kernel, 2, axis=1)[R], np.split(bias, 2)[R])
model = keras.Sequential([keras.Input((6,)), shard, keras.layers.Activation("tanh"), keras.layers.Dense(3)])
model.layers[-1].set_weights(reference.layers[-1].get_weights())
reference_sgd(reference, [(X, Y)], lr=0.1, momentum=0.0)
step = TrainStep(model, keras.optimizers.SGD(0.1), loss_fn, GradientSync(local_variables=shard.trainable_variables))
step(X, Y)
moved = float(np.abs(np.asarray(shard.kernel) - np.split(kernel, 2, axis=1)[R]).max())
ref_kernel, ref_bias = (np.split(np.asarray(v), 2, axis=-1)[R] for v in full.variables)
diff = max(max_rel_diff(model.layers[-1].variables, reference.layers[-1].variables),
           max_rel_diff(shard.variables, [ref_kernel, ref_bias]))
report("model_parallel_shards_match_full_layer", diff < TOL and moved > 1e-3,
       f"max rel diff {diff:.2e}, shard moved by {moved:.2e}")

# 7. Metrics over uneven shards: global sums / global count, not a mean of means.
values = np.arange(5.0) if R == 0 else np.arange(5.0, 7.0)
means = means_over_ranks({"v": values.sum()}, len(values), sum_over_ranks, "check.means")
report("metric_average_weights_by_count", abs(means["v"] - 3.0) < 1e-12, f"got {means['v']}")

# 8. Ranks initialised differently start identical after restore_checkpoint (optimizer too);
#    the LR warms up from lr to size x lr.
model = model_fn(seed=1000 + R)
scaled = OptimConfig(name="sgd", lr=0.1, momentum=0.9, scale_lr=True, warmup_epochs=1)
opt = make_optimizer(scaled, HorovodConfig(), ctx, steps_per_epoch=4)
with tempfile.TemporaryDirectory() as tmp:
    state = restore_checkpoint(CheckpointStore(tmp, is_writer=R == 0), Parallel(model, opt, None), ctx)
report("broadcast_makes_ranks_identical",
       same_on_all_ranks(model.variables + opt.variables, "init") and state.epoch == 0)
lrs = []
for s in range(6):  # the optimizer's own iteration count drives the schedule
    opt.iterations.assign(s)
    lrs.append(float(opt.learning_rate))
expected_lrs = [0.1, 0.125, 0.15, 0.175, 0.2, 0.2]
report("lr_warms_up_to_world_size_times_lr", np.allclose(lrs, expected_lrs, atol=1e-7), f"{lrs}")

# 9. Adasum needs MPI: on Gloo it is refused up front instead of failing inside the first allreduce.
try:
    GradientSync(adasum=True)
    refused = hvd.mpi_enabled()
except ValueError as exc:
    refused = "MPI" in str(exc)
report("adasum_on_gloo_refused_clearly", refused)


# 10. A job stopped after a mid-epoch checkpoint and resumed (fresh, differently initialised
#     processes) ends where an uninterrupted job ends: weights, momentum, step and epoch.
class Stop(Exception):
    pass


data = Split(rng.normal(size=(40, 6)).astype(np.float32), rng.integers(0, 3, size=40).astype(np.int64))


def job(seed):
    model = model_fn(seed=seed)
    opt = make_optimizer(sgd, HorovodConfig(), ctx, steps_per_epoch=5)
    return model, opt, TrainStep(model, opt, loss_fn, GradientSync())


batches = ShardedBatches(data, 4, R, 2, seed=1)
model, opt, step = job(seed=123)
with tempfile.TemporaryDirectory() as tmp:
    store = checkpoint_store(CheckpointConfig(dir=tmp), ctx)
    straight = restore_checkpoint(store, Parallel(model, opt, None), ctx)
    for _ in range(2):
        train_epoch(step, batches, straight, is_root=ctx.is_root)
    expected = [np.asarray(v) for v in model.variables + opt.variables]

    model, opt, step = job(seed=123)
    stopped = restore_checkpoint(store, Parallel(model, opt, None), ctx)

    def save_and_stop():
        save_checkpoint(store, Parallel(model, opt, None), stopped, ctx)
        raise Stop

    try:
        while stopped.epoch < 2:
            train_epoch(step, batches, stopped, is_root=ctx.is_root, every=[Every(7, save_and_stop)])  # step 7: mid epoch 1
    except Stop:
        pass
    model, opt, step = job(seed=999 + R)
    resumed = restore_checkpoint(store, Parallel(model, opt, None), ctx)
    at = (resumed.epoch, resumed.step, resumed.samples_in_epoch)
    while resumed.epoch < 2:
        train_epoch(step, batches, resumed, is_root=ctx.is_root)
    written = len(store.paths())
diff = max_rel_diff(model.variables + opt.variables, expected)
report("mid_epoch_resume_matches_uninterrupted",
       at == (1, 7, 16) and resumed.step == straight.step == 10 and diff < TOL and written == (1 if R == 0 else 0),
       f"resumed at (epoch, step, samples) {at}, max rel diff {diff:.2e}")


# 11. model.fit (Keras 3's own train step, with the allreduce wrapped around apply_gradients) on
#     each rank's half of every global batch, from differently initialised ranks, equals plain
#     fit on the global batches in one process; the epoch's logged loss is averaged over ranks.
fit_x = rng.normal(size=(32, 6)).astype(np.float32)
fit_y = rng.integers(0, 3, size=32).astype(np.int64)
reference = model_fn(seed=500)  # rank 0's initialisation, which the broadcast hands to every rank
reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn)
reference.fit(fit_x, fit_y, batch_size=16, epochs=2, shuffle=False, verbose=0)
mine = np.concatenate([halves(fit_x[:16]), halves(fit_x[16:])]), np.concatenate([halves(fit_y[:16]), halves(fit_y[16:])])
model = model_fn(seed=500 + R)
model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn)
distribute_fit(model, GradientSync())
history = model.fit(*mine, batch_size=8, epochs=2, shuffle=False, verbose=0,
                    callbacks=[AverageMetrics(), BroadcastVariables()])
diff = max_rel_diff(model.variables, reference.variables)
losses = hvd.allgather_object(history.history["loss"], name="fit_losses")
report("fit_matches_global_batch_reference", diff < TOL and same_on_all_ranks(model.variables, "fit")
       and losses[0] == losses[1], f"max rel diff {diff:.2e}")

# A non-finite update (rank 1's second batch is NaN): skipped in the graph on both ranks alike, the
# optimizer's momentum with it, so each rank ends equal to one process trained on the first and
# third global batches only; under `stop` both ranks stop at that step, before its update.
steps = [(np.roll(X, 3 * s, axis=0), np.roll(Y, 3 * s)) for s in range(3)]
reference = reference_sgd(model_fn(), [steps[0], steps[2]], lr=0.1, momentum=0.9)
for policy in ("skip", "stop"):
    model = model_fn()
    guard = Guard(policy, max_skipped=1, is_root=lambda: False)
    step = TrainStep(model, make_optimizer(sgd, HorovodConfig(), ctx, steps_per_epoch=3), loss_fn, GradientSync(),
                     guard=guard)
    stopped_at, after_first = None, None
    for i, (x, y) in enumerate(steps):
        x = halves(x).copy()
        if i == 1 and R == 1:
            x[0, 0] = np.nan
        try:
            step.train_batch(x, halves(y), True, i)
        except NonFinite as exc:
            stopped_at = exc.step
            break
        after_first = after_first or [np.array(v) for v in model.variables]
    if policy == "skip":
        diff = max_rel_diff(model.variables, reference.variables)
        report("a_nonfinite_update_is_skipped_on_every_rank_alike", diff < TOL and guard.skipped == 1,
               f"max rel diff {diff:.2e}, {guard.skipped} skipped")
    else:
        same = all(np.array_equal(np.array(v), a) for v, a in zip(model.variables, after_first))
        report("a_nonfinite_update_stops_every_rank_before_it", stopped_at == 2 and same, f"stopped at {stopped_at}")

# 9. Recomputed blocks (model.recompute: blocks): averaged momentum-SGD steps with every
# layer's call run again in backward (tf.recompute_grad) == the same steps keeping the activations;
# a block that draws dropout masks is refused in one line (they would differ the second time).
recomputed = recompute_blocks(model_fn())
step = TrainStep(recomputed, make_optimizer(sgd, HorovodConfig(), ctx, steps_per_epoch=5), loss_fn, GradientSync())
for x, y in steps:
    step(halves(x), halves(y))
reference = reference_sgd(model_fn(), steps, lr=0.1, momentum=0.9)
diff = max_rel_diff(recomputed.variables, reference.variables)
try:
    recompute_blocks(keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dropout(0.5, name="dropped")]))
    refused = ""
except ConfigError as exc:
    refused = str(exc)
report("recomputed_blocks_match_kept_activations",
       diff < TOL and refused.startswith("model.recompute blocks runs each block's forward twice, and block dropped"),
       f"max rel diff {diff:.2e}; {refused!r}")
