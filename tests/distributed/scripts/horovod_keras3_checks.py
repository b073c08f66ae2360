"""Horovod's own Keras 3 API, as hvdgen patches it, checked under `horovodrun -np 2`.

For users who import Horovod's Keras layer rather than hvd_runtime: `hvd.DistributedOptimizer` in
`model.fit` and in a custom loop, its callbacks, `SyncBatchNormalization`, local variables
(`PartialDistributedGradientTape`, `PartialDistributedOptimizer`) and `broadcast_variables`. Every
rank trains on different data; each result is compared with one process doing the same work on
the global batch (plain Keras, computed here in every rank). Prints `OK <name>` on rank 0 per check.

`python horovod_keras3_checks.py [NAME ...]` runs only the named checks: an unpatched Horovod
fails each one on its own, which is how each patch is shown to be needed.
"""

import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore")

import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

hvd.init()
assert hvd.size() == 2, "run with -np 2"
R = hvd.rank()
TOL = 1e-5
LR = 0.1
rng = np.random.default_rng(7)
X = rng.normal(size=(16, 6)).astype(np.float32)
Y = rng.integers(0, 3, size=16).astype(np.int64)
PER_RANK_BATCH = 4


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mine(a):
    """This rank's half of the data: the ranks see different examples."""
    return np.split(a, 2)[R]


def global_batches(a):
    """The same examples in the order one process sees them: step k's global batch is every
    rank's k-th batch, so a global batch of 8 is two ranks' batches of 4."""
    halves = [np.split(h, len(h) // PER_RANK_BATCH) for h in np.split(a, 2)]
    return np.concatenate([np.concatenate(step) for step in zip(*halves)])


def model_fn(seed=123, batch_norm=None):
    keras.utils.set_random_seed(seed)  # identical initial weights wherever the seed is the same
    # A bias before batch normalization has a zero gradient (the mean removes it): none there.
    layers = [keras.Input((6,)), keras.layers.Dense(8, use_bias=batch_norm is None)]
    layers += [batch_norm] if batch_norm is not None else []
    layers += [keras.layers.ReLU(), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def max_rel_diff(a_vars, b_vars) -> float:
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-12))
               for a, b in zip(a_vars, b_vars))


def on_all_ranks(values, name):
    return hvd_tf.allgather_object([np.asarray(v) for v in values], name=name)


def identical_on_all_ranks(values, name) -> bool:
    everyone = on_all_ranks(values, name)
    return all(np.array_equal(a, b) for other in everyone[1:] for a, b in zip(everyone[0], other))


def fit_distributed(optimizer, callbacks=()):
    model = model_fn()
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss=loss_fn())
    history = model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history


def fit_reference(optimizer):
    model = model_fn()
    model.compile(optimizer=optimizer, loss=loss_fn())
    history = model.fit(global_batches(X), global_batches(Y), batch_size=2 * PER_RANK_BATCH, epochs=2,
                        shuffle=False, verbose=0)
    return model, history


def fit_averages_gradients():
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    model, _ = fit_distributed(keras.optimizers.SGD(LR, momentum=0.9), callbacks)
    reference, _ = fit_reference(keras.optimizers.SGD(LR, momentum=0.9))
    same = identical_on_all_ranks(model.get_weights(), "fit")
    diff = max_rel_diff(model.get_weights(), reference.get_weights())
    return same and diff < TOL, f"ranks identical: {same}, max rel diff to one process {diff:.1e}"


def metric_average_callback_averages_loss():
    callbacks = [hvd.callbacks.MetricAverageCallback()]
    _, history = fit_distributed(keras.optimizers.SGD(LR), callbacks)
    _, ref_history = fit_reference(keras.optimizers.SGD(LR))
    # Each rank's epoch loss is the mean over its own batches; averaged over ranks it is the
    # mean over all batches, the loss one process reports on the global batches.
    diff = max_rel_diff(history.history["loss"], ref_history.history["loss"])
    return diff < TOL, f"logged loss vs one process: max rel diff {diff:.1e}"


def fit_with_variable_groups():
    model = model_fn()
    groups = [[model.layers[0].kernel, model.layers[-1].kernel]]  # both named "kernel" in Keras 3
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), groups=groups), loss=loss_fn())
    model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0)
    reference, _ = fit_reference(keras.optimizers.SGD(LR))
    same = identical_on_all_ranks(model.get_weights(), "groups")
    diff = max_rel_diff(model.get_weights(), reference.get_weights())
    return same and diff < TOL, f"ranks identical: {same}, max rel diff to one process {diff:.1e}"


def keras_gradient_accumulation_with_distributed_optimizer():
    model, _ = fit_distributed(keras.optimizers.SGD(LR, gradient_accumulation_steps=2))
    reference, _ = fit_reference(keras.optimizers.SGD(LR, gradient_accumulation_steps=2))
    diff = max_rel_diff(model.get_weights(), reference.get_weights())
    return diff < TOL, f"max rel diff to one process {diff:.1e}"


def backward_passes_per_step_refused_clearly():
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2)
    except ValueError as e:
        return "gradient_accumulation_steps=2" in str(e), str(e)
    return False, "accepted, though Horovod's local aggregation cannot run on a Keras 3 optimizer"


def custom_loop_apply_gradients_averages():
    """hvd.DistributedOptimizer from horovod.tensorflow (not .keras) on a Keras 3 optimizer, in a
    GradientTape loop that calls apply_gradients() itself."""
    model, reference = model_fn(), model_fn()
    optimizer = hvd_tf.DistributedOptimizer(keras.optimizers.SGD(LR))
    ref_optimizer = keras.optimizers.SGD(LR)
    for (x, y), (gx, gy) in zip(zip(np.split(mine(X), 2), np.split(mine(Y), 2)),
                                zip(np.split(global_batches(X), 2), np.split(global_batches(Y), 2))):
        with tf.GradientTape() as tape:
            loss = loss_fn()(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        with tf.GradientTape() as tape:
            loss = loss_fn()(gy, reference(gx, training=True))
        ref_optimizer.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables),
                                          reference.trainable_variables))
    diff = max_rel_diff(model.get_weights(), reference.get_weights())
    return diff < TOL, f"max rel diff to one process {diff:.1e}"


def partial_tape_keeps_local_source():
    """The head is local: its gradient is this rank's own (Horovod divides it by the number of
    ranks unless scale_local_gradients=False); every other gradient is the ranks' average."""
    model = model_fn()
    head = model.layers[-1]
    x, y = mine(X), mine(Y)

    def gradients(wrap):
        with tf.GradientTape() as tape:
            loss = loss_fn()(y, model(x, training=True))
        return [np.asarray(g) for g in wrap(tape).gradient(loss, model.trainable_variables)]

    own = gradients(lambda tape: tape)
    mean = [np.mean(gs, axis=0) for gs in zip(*on_all_ranks(own, "own_grads"))]
    is_local = [any(v is w for w in head.trainable_variables) for v in model.trainable_variables]
    partial = gradients(lambda tape: hvd_tf.PartialDistributedGradientTape(tape, local_layers=[head]))

    def unscaled(tape):
        tape = hvd_tf.DistributedGradientTape(tape, scale_local_gradients=False)
        for v in head.trainable_variables:
            tape.register_local_source(v)
        return tape

    registered = gradients(unscaled)
    ok_partial = all(np.allclose(g, o / 2 if local else m, rtol=TOL, atol=1e-7)
                     for g, o, m, local in zip(partial, own, mean, is_local))
    ok_registered = all(np.allclose(g, o if local else m, rtol=TOL, atol=1e-7)
                        for g, o, m, local in zip(registered, own, mean, is_local))
    head_differs = not np.allclose(*[gs[-2] for gs in on_all_ranks(own, "own_grads_2")])
    return ok_partial and ok_registered and head_differs, \
        f"local_layers: {ok_partial}, register_local_source: {ok_registered}, ranks' head gradients differ: {head_differs}"


def partial_optimizer_keeps_local_layer():
    import horovod.keras as hvd_keras

    model = model_fn()
    head = model.layers[-1]
    optimizer = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=[head])
    model.compile(optimizer=optimizer, loss=loss_fn())
    model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0)
    shared = [v for v in model.trainable_variables if not any(v is w for w in head.trainable_variables)]
    shared_same = identical_on_all_ranks(shared, "shared")
    head_differs = not identical_on_all_ranks(head.trainable_variables, "head")
    return shared_same and head_differs, f"shared identical: {shared_same}, local head differs: {head_differs}"


def broadcast_variables_keras3():
    model = model_fn(seed=100 + R)  # different weights on every rank
    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    rank0 = model_fn(seed=100)
    same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), rank0.get_weights()))
    return same, "every rank holds rank 0's weights" if same else "weights not those of rank 0"


def broadcast_callback_skips_local_variables():
    """BroadcastGlobalVariablesCallback gives every rank rank 0's weights except the local ones.
    A learning rate of 0 leaves the weights exactly where the broadcast put them."""
    model = model_fn(seed=100 + R)  # different weights on every rank
    head = model.layers[-1]
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss=loss_fn())
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=head.trainable_variables)
    model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    rank0, own = model_fn(seed=100), model_fn(seed=100 + R)
    body = all(np.array_equal(a, b) for a, b in zip(model.layers[0].get_weights(), rank0.layers[0].get_weights()))
    local = all(np.array_equal(a, b) for a, b in zip(head.get_weights(), own.layers[-1].get_weights()))
    return body and local, f"body is rank 0's: {body}, local head is this rank's own: {local}"


def sync_batchnorm_matches_global_batch():
    """Forward pass, moving statistics and gradients of hvd.SyncBatchNormalization in a model, on
    each rank's half of the batch, against BatchNormalization on the whole batch."""
    synced = model_fn(batch_norm=hvd_tf.SyncBatchNormalization(momentum=0.9))
    reference = model_fn(batch_norm=keras.layers.BatchNormalization(momentum=0.9))
    x, gx = mine(X) * 3.0 + R, X * 3.0 + np.repeat([0.0, 1.0], 8)[:, None].astype(np.float32)
    for _ in range(2):  # the second step sees moving statistics the first one updated
        synced_out = synced(x, training=True)
        reference_out = reference(gx, training=True)
    forward = max_rel_diff([synced_out], [mine(np.asarray(reference_out))])
    bn, ref_bn = synced.layers[1], reference.layers[1]
    stats = max_rel_diff([bn.moving_mean, bn.moving_variance], [ref_bn.moving_mean, ref_bn.moving_variance])

    def loss(model, inputs, labels):
        return loss_fn()(labels, model(inputs, training=True))

    with tf.GradientTape() as tape:
        local_loss = loss(synced, x, mine(Y))
    grads = hvd_tf.DistributedGradientTape(tape).gradient(local_loss, synced.trainable_variables)
    with tf.GradientTape() as tape:
        global_loss = loss(reference, gx, Y)
    ref_grads = tape.gradient(global_loss, reference.trainable_variables)
    backward = max_rel_diff(grads, ref_grads)
    return max(forward, stats, backward) < TOL, \
        f"max rel diff: output {forward:.1e}, moving stats {stats:.1e}, gradients {backward:.1e}"



def broadcast_callback_with_a_plain_optimizer():
    """model.compile(optimizer=<a Keras optimizer Horovod did not wrap>) with the broadcast callback:
    every rank holds rank 0's weights and optimizer state (RMSprop's velocities) after the batch,
    the only one; a learning rate of 0 leaves the weights where the broadcast put them."""
    model = model_fn(seed=100 + R)
    model.compile(optimizer=keras.optimizers.RMSprop(0.0), loss=loss_fn())
    one_batch = slice(0, PER_RANK_BATCH)
    model.fit(mine(X)[one_batch], mine(Y)[one_batch], batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    rank0 = model_fn(seed=100)
    weights = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), rank0.get_weights()))
    state = identical_on_all_ranks(model.optimizer.variables, "plain_optimizer_state")
    return weights and state, f"rank 0's weights: {weights}, optimizer state identical: {state}"


def elastic_keras_state_with_a_plain_optimizer():
    """hvd.elastic.KerasState(model, optimizer) of a Keras optimizer Horovod did not wrap: restore()
    gives back the committed weights and momentum exactly, sync() rank 0's to every rank."""
    model = model_fn(seed=100 + R)
    optimizer = keras.optimizers.SGD(LR, momentum=0.9)
    model.compile(optimizer=optimizer, loss=loss_fn())
    model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)  # momentum made
    state = hvd.elastic.KerasState(model, optimizer, epoch=1)
    state.commit()
    committed = [np.array(v) for v in model.variables + optimizer.variables]
    model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    moved = not all(np.array_equal(a, b) for a, b in zip(committed, model.variables + optimizer.variables))
    state.restore()
    restored = all(np.array_equal(a, b) for a, b in zip(committed, model.variables + optimizer.variables))
    state.sync()
    synced = identical_on_all_ranks(model.variables + optimizer.variables, "elastic_synced")
    rank0s = on_all_ranks(committed, "elastic_committed")[0]
    from_rank0 = all(np.array_equal(a, b) for a, b in zip(rank0s, model.variables + optimizer.variables))
    return moved and restored and synced and from_rank0, \
        f"trained past the commit: {moved}, restored: {restored}, synced to rank 0's: {synced and from_rank0}"


def lr_warmup_callback_on_keras3():
    """LearningRateWarmupCallback ramps the rate per batch from initial_lr / size to initial_lr over
    its epochs, as Horovod's formula says, and logs it; Keras 3's SGD holds momentum as a constant of
    its compiled step, so the momentum correction is skipped with one warning."""
    model = model_fn()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss=loss_fn())
    steps = len(mine(X)) // PER_RANK_BATCH
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(float(np.asarray(model.optimizer.learning_rate))))
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=2 * LR, warmup_epochs=2, steps_per_epoch=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=3, shuffle=False, verbose=0,
                  callbacks=[warmup, record])
    expected = [2 * LR / 2 * ((e + (b + 1) / steps) * (2 - 1) / 2 + 1) for e in range(2) for b in range(steps)]
    expected += [expected[-1]] * steps   # after the warm-up the rate stays where it ended
    ramp = np.allclose(seen, expected, rtol=TOL)
    warned = sum("momentum correction skipped" in str(w.message) for w in caught) == 1
    same = identical_on_all_ranks(model.get_weights(), "warmup")
    return ramp and warned and same, f"rates {np.round(seen, 4).tolist()}, one warning: {warned}, ranks identical: {same}"


def lr_schedule_callback_on_keras3():
    """LearningRateScheduleCallback (staircase) multiplies the rate at each epoch from start_epoch
    on, and logs it in the epoch's logs."""
    model = model_fn()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(LR)), loss=loss_fn())
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, multiplier=0.5, start_epoch=1)
    history = model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[schedule])
    logged = [float(v) for v in history.history["lr"]]
    ok = np.allclose(logged, [LR, LR, LR / 2], rtol=TOL)
    return ok, f"logged rates {logged}"


def partial_optimizer_compute_gradients_in_a_custom_loop():
    """PartialDistributedOptimizer's compute_gradients + apply_gradients (Keras 2's methods, which
    Keras 3 optimizers lack): shared gradients averaged, the local head's this rank's own divided by
    the number of ranks, and reduced once: one step of SGD gives exactly those updates."""
    import horovod.keras as hvd_keras

    model = model_fn()
    head = model.layers[-1]
    x, y = mine(X), mine(Y)
    before = [np.array(v) for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = loss_fn()(y, model(x, training=True))
    own = [np.asarray(g) for g in tape.gradient(loss, model.trainable_variables)]
    mean = [np.mean(gs, axis=0) for gs in zip(*on_all_ranks(own, "partial_own"))]
    is_local = [any(v is w for w in head.trainable_variables) for v in model.trainable_variables]
    optimizer = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=[head])
    with tf.GradientTape() as tape:
        loss = loss_fn()(y, model(x, training=True))
    optimizer.apply_gradients(optimizer.compute_gradients(loss, model.trainable_variables, tape=tape))
    expected = [w - LR * (o / 2 if local else m) for w, o, m, local in zip(before, own, mean, is_local)]
    diff = max_rel_diff(model.trainable_variables, expected)
    return diff < TOL, f"max rel diff to the expected step {diff:.1e}"


def load_model_wraps_the_saved_optimizer():
    """hvd.load_model of a model saved (.keras) with a DistributedOptimizer: the optimizer comes back
    wrapped, with its momentum, and training on from it keeps averaging: equal to the model trained
    on without the save, and the ranks identical."""
    import tempfile

    model = model_fn()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss=loss_fn())
    model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        model.save(f"{tmp}/model.keras")
        loaded = hvd.load_model(f"{tmp}/model.keras")
    wrapped = hasattr(loaded.optimizer, "_allreduce")
    state = all(np.array_equal(a, b) for a, b in zip(loaded.optimizer.variables, model.optimizer.variables))
    for m in (model, loaded):
        m.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    diff = max_rel_diff(loaded.get_weights(), model.get_weights())
    same = identical_on_all_ranks(loaded.get_weights(), "loaded")
    return wrapped and state and diff < TOL and same, \
        f"wrapped: {wrapped}, momentum kept: {state}, trained on: max rel diff {diff:.1e}, ranks identical: {same}"


def horovod_keras_callbacks_on_keras3():
    """The callbacks of `horovod.keras` (Horovod's layer for standalone Keras): the epoch's loss
    averaged over the ranks, as one process reports it on the global batches, and the scheduled
    rate logged."""
    import horovod.keras as hvd_keras

    model = model_fn()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR)), loss=loss_fn())
    callbacks = [hvd_keras.callbacks.MetricAverageCallback(),
                 hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=LR, multiplier=1.0)]
    history = model.fit(mine(X), mine(Y), batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=callbacks)
    _, ref_history = fit_reference(keras.optimizers.SGD(LR))
    diff = max_rel_diff(history.history["loss"], ref_history.history["loss"])
    rates = np.allclose(history.history["lr"], [LR, LR], rtol=TOL)
    return diff < TOL and rates, f"logged loss vs one process: max rel diff {diff:.1e}, rates logged: {rates}"

CHECKS = {check.__name__: check for check in (
    fit_averages_gradients, metric_average_callback_averages_loss, fit_with_variable_groups,
    keras_gradient_accumulation_with_distributed_optimizer, backward_passes_per_step_refused_clearly,
    custom_loop_apply_gradients_averages, partial_tape_keeps_local_source, partial_optimizer_keeps_local_layer,
    broadcast_variables_keras3, broadcast_callback_skips_local_variables, sync_batchnorm_matches_global_batch,
    broadcast_callback_with_a_plain_optimizer, elastic_keras_state_with_a_plain_optimizer, lr_warmup_callback_on_keras3,
    lr_schedule_callback_on_keras3, partial_optimizer_compute_gradients_in_a_custom_loop,
    load_model_wraps_the_saved_optimizer, horovod_keras_callbacks_on_keras3,
)}

unknown = set(sys.argv[1:]) - set(CHECKS)
if unknown:
    sys.exit(f"unknown checks {sorted(unknown)}: choose from {sorted(CHECKS)}")
failed = []
for name in sys.argv[1:] or CHECKS:
    try:
        ok, detail = CHECKS[name]()
    except Exception as e:  # an unpatched Horovod fails by raising: that is this check's failure
        last_line = (str(e).strip().splitlines() or [""])[-1].strip()  # TF's "in user code:" puts it last
        ok, detail = False, last_line[:300] if last_line.startswith(type(e).__name__) \
            else f"{type(e).__name__}: {last_line[:300]}"
    # Every check is reported, not only the first failure: each patch has its own checks.
    if not all(hvd_tf.allgather_object(bool(ok), name=f"ok_{name}")):
        failed.append(name)
    if R == 0:
        print(("FAIL " if name in failed else "OK ") + name + (f" ({detail})" if detail else ""), flush=True)
sys.exit(1 if failed else 0)
