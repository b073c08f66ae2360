"""hvd_runtime.tf pieces that need no second process: batching, LR schedule, accumulation, SyncBN swap."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed: the TF runtime is not tested here")
keras = pytest.importorskip("keras")

from hvd_runtime.data import Split  # noqa: E402
from hvd_runtime.tf.batches import ShardedBatches  # noqa: E402
from hvd_runtime.scaling import cpu_threads  # noqa: E402
from hvd_runtime.tf.gradients import GradientAccumulator  # noqa: E402
from hvd_runtime.scaling import lr_scaler  # noqa: E402
from hvd_runtime.tf.optim import WarmupSchedule  # noqa: E402
from hvd_runtime.tf.sync_batchnorm import SyncBatchNormalization, use_sync_batchnorm  # noqa: E402
from hvd_runtime.tf.native_logs import NO_GPU_NOTICE, host_has_nvidia_device, notices  # noqa: E402
from hvd_runtime.tf.native_logs import quiet_native_notices  # noqa: E402


LEAN_IMPORT_CHECK = """
import sys
{before}
import hvd_runtime.tf
import keras.src.visualization.plot_image_gallery as gallery
import keras.src.wrappers.fixes as fixes
import keras.src.trainers.data_adapters.array_slicing as slicing
print(fixes.sklearn is not None, gallery.plt is not None, slicing.pandas is not None,
      "sklearn" in sys.modules, "matplotlib" in sys.modules, "pandas" in sys.modules)
import matplotlib.pyplot, sklearn.datasets, pandas  # afterwards, all import as usual
print(sys.modules["sklearn"] is sklearn, sys.modules["matplotlib.pyplot"] is matplotlib.pyplot,
      sys.modules["pandas"] is pandas)
from hvd_runtime.tf.context import physical_gpus
physical_gpus()   # the first device query: where a GPU-less host gets its cuInit notice
"""


@pytest.mark.parametrize("before, keras_sees", [("", "False False False False False False"),
                                                # scikit-learn imports pandas itself: neither is hidden
                                                ("import sklearn", "True False True True False True"),
                                                ("import pandas", "False False True False False True")])
def test_tensorflow_comes_in_without_keras_extras_the_process_has_not_imported(before, keras_sees):
    """hvd_runtime.tf imports TensorFlow with scikit-learn, matplotlib and pandas hidden from Keras
    (seconds of every rank's start-up), unless the process imported them first; later they import
    as usual."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", LEAN_IMPORT_CHECK.format(before=before)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [keras_sees, "True True True"], proc.stdout
    # and TensorFlow's native start-up notices stayed out of stderr (hvd_runtime.tf.native_logs)
    assert native_notices(proc.stderr) == [], proc.stderr


def native_notices(stderr: str) -> list[str]:
    patterns = notices(gpu_host=False)
    return [line for line in stderr.splitlines() if any(re.match(pattern, line) for pattern in patterns)]


def test_tensorflow_start_up_notices_show_with_tf_cpp_min_log_level_0():
    """The user's way to see everything TensorFlow writes; and proof that this TensorFlow writes
    the notices the check above finds absent. oneDNN is asked for: TensorFlow turns it on by
    itself (and says so) only on CPUs with AVX-512-class instructions."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", LEAN_IMPORT_CHECK.format(before="")], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "TF_ENABLE_ONEDNN_OPTS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = native_notices(proc.stderr)
    assert any("oneDNN custom operations are on" in line for line in shown), proc.stderr
    assert any(re.match(NO_GPU_NOTICE, line) for line in shown) != host_has_nvidia_device(), proc.stderr


NATIVE_NOTICES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1795886042.681730    3625 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders. To turn "
    "them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
    "I0000 00:00:1795886042.684269    3625 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
    "not be used.\n"
    "I0000 00:00:1795886042.827067    3625 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use "
    "available CPU instructions in performance-critical operations.\n"
    "To enable the following instructions: AVX2 AVX512F AMX_TILE FMA, in other operations, rebuild TensorFlow with "
    "the appropriate compiler flags.\n")
CUINIT = ("E0000 00:00:1795886044.791680    3625 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          "Failed call to cuInit: UNKNOWN ERROR (303)\n")
REAL = "E0000 00:00:1795886044.791680    3625 some_kernel.cc:12] a real error\n"


def test_native_notices_are_dropped_from_what_the_block_wrote_and_the_rest_comes_back_in_order(capfd, monkeypatch):
    """Written to file descriptor 2, as C++ writes: only the notices go; a real error, Python's own
    lines and output far larger than a pipe holds come back, in order."""
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    big = "x" * 200_000 + "\n"
    with quiet_native_notices():
        os.write(2, (NATIVE_NOTICES + REAL).encode())
        print("python's own line", file=sys.__stderr__, flush=True)   # sys.stderr of a process (pytest swaps it)
        os.write(2, (NATIVE_NOTICES + CUINIT + big).encode())
    err = capfd.readouterr().err
    assert err == REAL + "python's own line\n" + ("" if not host_has_nvidia_device() else CUINIT) + big


def test_the_cuinit_notice_stays_where_the_host_has_an_nvidia_device(tmp_path):
    """On a GPU host, cuInit failing is why the GPU goes unused: that line is kept."""
    def dropped(line: str, gpu_host: bool) -> bool:
        return any(re.match(pattern, line) for pattern in notices(gpu_host))

    assert dropped(CUINIT, gpu_host=False) and not dropped(CUINIT, gpu_host=True)
    assert all(dropped(line, gpu_host=True) for line in NATIVE_NOTICES.splitlines())
    assert not dropped(REAL, gpu_host=False)
    assert not host_has_nvidia_device(tmp_path)
    (tmp_path / "nvidiactl").touch()
    assert host_has_nvidia_device(tmp_path)


def split(n: int) -> Split:
    return Split(np.arange(n, dtype=np.float32).reshape(n, 1), np.arange(n, dtype=np.int64))


def labels(batches: ShardedBatches, epoch: int = 0, consumed: int = 0) -> list[int]:
    return [int(v) for _, y in batches.batches(epoch, consumed) for v in y.numpy()]


def test_tf_data_reads_token_windows_and_images_as_the_splits_give_them(tmp_path):
    from hvd_runtime.data import load_image_folder, load_tokens
    from test_streamed_data import write_images, write_tokens

    write_tokens(tmp_path / "tokens", np.arange(200) % 7, vocab=7)
    val = load_tokens(tmp_path / "tokens", context=4).val
    batches = list(ShardedBatches(val, 5, rank=0, size=1, train=False))
    x, y = (np.concatenate([b[i].numpy() for b in batches]) for i in (0, 1))
    assert x.dtype == np.int64 and x.shape == y.shape == (len(val), 4)
    np.testing.assert_array_equal((x, y), val.take(np.arange(len(val))))

    write_images(tmp_path / "images")
    train = load_image_folder(tmp_path / "images", image_size=8, seed=1).train
    sharded = ShardedBatches(train, 4, rank=1, size=2, seed=5)
    first = next(sharded.batches(epoch=2, consumed=4))
    np.testing.assert_array_equal(first[0].numpy(), train.take(sharded.indices(2, 4)[:4], 2)[0])


def test_a_file_that_goes_bad_mid_epoch_reaches_the_loop_as_one_data_error(tmp_path):
    from hvd_runtime.data import DataError, load_image_folder
    from test_streamed_data import write_images

    write_images(tmp_path)
    train = load_image_folder(tmp_path, image_size=8).train
    for file in train.files:
        (tmp_path / file).write_bytes((tmp_path / file).read_bytes()[:60])
    with pytest.raises(DataError) as error:
        list(ShardedBatches(train, 4, rank=0, size=1).batches())
    assert "is not a readable image" in str(error.value) and "\n" not in str(error.value)


def test_no_pipeline_autotunes_so_freeing_an_epochs_iterator_never_waits_for_its_model_thread(tmp_path):
    """With autotuning, freeing an epoch's iterator waited out the model thread's sleep: 2.4 s at
    about every other epoch's end (hvd_runtime.tf.batches). Off for in-memory and streamed splits."""
    from hvd_runtime.data import load_image_folder
    from test_streamed_data import write_images

    write_images(tmp_path)
    for train in (split(13), load_image_folder(tmp_path, image_size=8).train):
        dataset = ShardedBatches(train, 4, rank=0, size=1).dataset(epoch=1)
        assert dataset.options().autotune.enabled is False
        assert len(list(dataset)) == len(ShardedBatches(train, 4, rank=0, size=1))


def test_uneven_training_shards_take_the_same_number_of_steps_and_cover_everything():
    ranks = [ShardedBatches(split(13), 4, rank, 2, seed=1) for rank in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2  # ceil(ceil(13 / 2) / 4)
    seen = [labels(b) for b in ranks]
    assert len(seen[0]) == len(seen[1]) == 7  # padded to 14 samples
    assert set(seen[0]) | set(seen[1]) == set(range(13))
    assert len(set(seen[0]) & set(seen[1])) == 1  # only the one sample repeated to pad


def test_evaluation_shards_are_disjoint_and_see_every_sample_once():
    ranks = [ShardedBatches(split(13), 4, rank, 2, train=False) for rank in range(2)]
    seen = [labels(b) for b in ranks]
    assert sorted(seen[0] + seen[1]) == list(range(13))
    assert [len(b) for b in ranks] == [2, 2]


def test_epochs_reshuffle_identically_on_every_rank_and_resume_mid_epoch():
    a, b = ShardedBatches(split(40), 5, 0, 2, seed=3), ShardedBatches(split(40), 5, 0, 2, seed=3)
    assert labels(a, epoch=1) == labels(b, epoch=1) != labels(a, epoch=0)
    # Two steps done: 2 steps x 5 per rank x 2 ranks = 20 samples of the epoch's order consumed.
    assert a.samples_per_step == 10 and a.steps(20) == 2
    assert labels(a, epoch=1, consumed=20) == labels(a, epoch=1)[10:]
    assert [x.numpy()[:, 0].tolist() for x, _ in a.batches(1)][0] == labels(a, epoch=1)[:5]  # x rows follow y


def test_warmup_ramps_from_one_rank_lr_to_scaled_lr_then_stays():
    schedule = WarmupSchedule(lr=0.1, scaler=4.0, warmup_steps=3)
    assert np.allclose([float(schedule(s)) for s in range(5)], [0.1, 0.2, 0.3, 0.4, 0.4])
    assert float(WarmupSchedule(0.1, 4.0, 0)(0)) == pytest.approx(0.4)
    assert WarmupSchedule.from_config(schedule.get_config()).get_config() == schedule.get_config()


def test_lr_scaler_follows_world_size_or_adasum_rule():
    assert lr_scaler(8, 4, scale_lr=True, adasum=False, gpu_allreduce=False) == 8.0
    assert lr_scaler(8, 4, scale_lr=False, adasum=False, gpu_allreduce=False) == 1.0
    assert lr_scaler(8, 4, scale_lr=True, adasum=True, gpu_allreduce=True) == 4.0
    assert lr_scaler(8, 4, scale_lr=True, adasum=True, gpu_allreduce=False) == 1.0


def test_accumulator_hands_on_the_mean_and_starts_again():
    v = keras.Variable(np.zeros(3, np.float32))
    acc = GradientAccumulator([v], k=2)
    acc.add([tf.constant([1.0, 2.0, 3.0])])
    acc.add([tf.constant([3.0, 2.0, 1.0])])
    assert acc.mean_and_reset()[0].numpy().tolist() == [2.0, 2.0, 2.0]
    acc.add([tf.constant([4.0, 0.0, 0.0])])
    assert acc.mean_and_reset()[0].numpy().tolist() == [2.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        GradientAccumulator([v], k=0)


@keras.saving.register_keras_serializable(package="tests")
class Normed(keras.layers.Layer):
    """A layer of a model's own holding a BatchNormalization, as a generated ResNet's residual block does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x, training=False):
        return self.norm(x, training=training)


def test_sync_batchnorm_swap_keeps_weights_and_the_model_code():
    keras.utils.set_random_seed(0)
    block = keras.Sequential([keras.layers.Dense(4), keras.layers.BatchNormalization()])
    model = keras.Sequential([keras.Input((3,)), block, Normed(), keras.layers.Dense(2)])
    model.layers[0].layers[1].moving_mean.assign(np.arange(4, dtype=np.float32))
    model.layers[1].norm.moving_variance.assign(np.arange(1, 5, dtype=np.float32))
    synced = use_sync_batchnorm(model)
    swapped = [layer for layer in synced._flatten_layers() if isinstance(layer, SyncBatchNormalization)]
    assert len(swapped) == 2
    assert not any(isinstance(layer, SyncBatchNormalization) for layer in model._flatten_layers())
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    assert np.allclose(synced(x, training=False), model(x, training=False))


def test_cpu_threads_share_the_cores_between_local_ranks():
    assert cpu_threads(local_size=1, requested=3) == 3
    assert cpu_threads(local_size=10_000) == 1


@pytest.fixture(scope="module")
def one_rank():
    """Horovod as a job of one process (no horovodrun): every collective is the identity."""
    hvd = pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run hvdgen install-horovod")
    hvd.init()
    assert hvd.size() == 1
    return hvd


@pytest.mark.parametrize("shape", [(16, 5), (4, 3, 3, 5)])
def test_sync_batchnorm_on_one_rank_is_keras_batchnorm(one_rank, shape):
    x = np.random.default_rng(1).normal(2.0, 3.0, size=shape).astype(np.float32)
    plain, synced = keras.layers.BatchNormalization(momentum=0.5), SyncBatchNormalization(momentum=0.5)
    out_plain, out_synced = plain(x, training=True), synced(x, training=True)
    assert np.allclose(out_synced, out_plain, atol=1e-5)
    assert np.allclose(synced.moving_mean, plain.moving_mean, atol=1e-5)
    assert np.allclose(synced.moving_variance, plain.moving_variance, rtol=1e-4)


def test_train_step_matches_a_plain_keras_step_with_regularization(one_rank):
    from hvd_runtime.tf.gradients import GradientSync
    from hvd_runtime.tf.step import TrainStep

    def model_fn():
        keras.utils.set_random_seed(4)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.5))])

    x = np.random.default_rng(2).normal(size=(8, 3)).astype(np.float32)
    y = np.arange(8, dtype=np.int64) % 2
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference, model = model_fn(), model_fn()
    with tf.GradientTape() as tape:
        loss = loss_fn(y, reference(x, training=True)) + tf.add_n(reference.losses)
    grads = tape.gradient(loss, reference.trainable_variables)
    keras.optimizers.SGD(0.1).apply_gradients(zip(grads, reference.trainable_variables))
    TrainStep(model, keras.optimizers.SGD(0.1), loss_fn, GradientSync())(x, y)
    for a, b in zip(model.variables, reference.variables):
        assert np.allclose(a, b, atol=1e-6)


def test_a_train_step_traces_its_code_as_written_without_autograph(one_rank, monkeypatch):
    """AutoGraph would parse and rewrite every function the trace reaches (Keras' optimizer and
    layers included): about 0.9 s of CPU in every TensorFlow rank. hvd_runtime.tf.compiled turns it off."""
    from tensorflow.python.autograph.impl import api as autograph

    from hvd_runtime.tf.compiled import compiled
    from hvd_runtime.tf.gradients import GradientSync
    from hvd_runtime.tf.step import TrainStep

    converted = []
    convert = autograph._convert_actual
    monkeypatch.setattr(autograph, "_convert_actual", lambda *a, **k: converted.append(a[0]) or convert(*a, **k))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    step = TrainStep(model, keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     GradientSync(), clip_norm=1.0, grad_norm=lambda g, v: tf.linalg.global_norm(g))
    x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
    step(x, y)
    step.evaluate([(x, y)])
    assert converted == []
    # the same spy sees AutoGraph where it is on: the check above can fail
    tf.function(lambda t: t + 1)(tf.constant(1.0))
    assert converted
    # and a branch on a tensor, which only AutoGraph could turn into graph control flow, fails the trace at once
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError, match="as a Python `bool`"):
        compiled(lambda t: t if t > 0 else -t)(tf.constant(1.0))


def _counted(fn, calls: list):
    """fn, appending to `calls` each time Python runs it (in a tf.function: once per trace)."""
    return lambda *args: calls.append(1) or fn(*args)


def test_a_train_step_is_traced_once_for_every_batch_size(one_rank):
    """An epoch's short last batch and the evaluation's must not retrace the step (seconds of CPU
    for a real model): one trace to train, one to evaluate, whatever the batch sizes."""
    from hvd_runtime.tf.gradients import GradientSync
    from hvd_runtime.tf.step import TrainStep

    traces = []
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    loss_fn = _counted(keras.losses.SparseCategoricalCrossentropy(from_logits=True), traces)
    step = TrainStep(model, keras.optimizers.SGD(0.1), loss_fn, GradientSync())
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(n, 3)).astype(np.float32), np.arange(n) % 2) for n in (8, 3, 5, 8)]
    for x, y in batches:
        loss, correct, applied = step(x, y)
        assert np.isfinite(loss) and bool(applied)
    assert len(traces) == 1
    step.evaluate(batches[:2])
    assert len(traces) == 2


def test_a_model_split_steps_batches_shorter_than_its_micro_batches(one_rank):
    """ModelSplit cuts a batch into min(micro_batches, its size): a step traced for any batch size
    would cut a batch of 2 into 4, two of them empty, and BatchNorm's statistics of an empty
    micro-batch are NaN. TrainStep traces a ModelSplit's step once for every batch of at least
    micro_batches samples, and per size below that."""
    from hvd_runtime.tf.gradients import GradientSync
    from hvd_runtime.tf.model_split import ModelSplit
    from hvd_runtime.tf.step import TrainStep

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.ReLU(), keras.layers.Dense(2)])
    split = ModelSplit(model, stages=2, devices=["/CPU:0", "/CPU:0"], micro_batches=4)
    traces = []
    loss_fn = _counted(keras.losses.SparseCategoricalCrossentropy(from_logits=True), traces)
    step = TrainStep(split, keras.optimizers.SGD(0.1), loss_fn, GradientSync())
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(n, 3)).astype(np.float32), np.arange(n) % 2) for n in (8, 5, 2, 1, 2)]
    for x, y in batches:
        loss, _, _ = step(x, y)
        assert np.isfinite(loss)
    assert all(np.isfinite(v.numpy()).all() for v in model.variables), "BatchNorm took an empty micro-batch"
    assert len(traces) == 3, "one trace for batches of 8 and 5, one each for 2 and 1"
    val_loss, _ = step.evaluate(batches[:3])
    assert np.isfinite(val_loss)
    assert len(traces) == 5


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b-batched-w"])
def test_the_tensorflow_pipeline_refuses_split_backward_schedules_in_one_line(schedule):
    """Before anything is built: the weight half would redo each block's backward (docs/pipeline.md)."""
    from hvd_runtime.config import ConfigError
    from hvd_runtime.tf.pipeline import PipelineEngine

    with pytest.raises(ConfigError, match=rf"^parallel.schedule {schedule} runs on PyTorch only: Keras layers inside "
                                          r"a block have no hook.*: use 1f1b$"):
        PipelineEngine(stage=None, place=None, loss_fn=None, optimizer=None, schedule=schedule)
