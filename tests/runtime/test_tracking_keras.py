"""log_model for a Keras model: mlflow.tensorflow, signature from the example, loads and predicts.

Runs where TensorFlow is installed (the TF environment); skipped elsewhere.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="Requires: tensorflow")
keras = pytest.importorskip("keras", reason="Requires: keras")
mlflow = pytest.importorskip("mlflow")

from hvd_runtime.config import RunConfig, TrackingConfig  # noqa: E402
from hvd_runtime.tracking import settings, start_tracking  # noqa: E402

EVERY_CHECKPOINT = RunConfig(tracking=TrackingConfig(checkpoint_models="every"))   # each log_model call is logged


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_keras_model_is_logged_with_the_tensorflow_flavor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    example = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    with start_tracking(EVERY_CHECKPOINT, rank=0, world_size=1, framework="tensorflow", strategy="data",
                        project_name="keras") as tracker:
        tracker.log_model(model, input_example=example)
        run_id = tracker.run_id
    uri = settings.embedded_uri(tmp_path)
    client = mlflow.MlflowClient(uri)
    (logged,) = client.search_logged_models(experiment_ids=[client.get_run(run_id).info.experiment_id])
    assert logged.source_run_id == run_id
    mlflow.set_tracking_uri(uri)
    try:
        info = mlflow.models.get_model_info(f"models:/{logged.model_id}")
        assert "tensorflow" in info.flavors
        assert list(info.signature.inputs.to_dict()[0]["tensor-spec"]["shape"]) == [-1, 4]
        loaded = mlflow.tensorflow.load_model(f"models:/{logged.model_id}")
        np.testing.assert_allclose(np.asarray(loaded(example)), np.asarray(model(example)), rtol=1e-5)
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_every_epoch_logs_without_tensorflows_retracing_warning(tmp_path, monkeypatch):
    """MLflow predicts each logged model's example, and each checkpoint is a fresh clone: from the
    fifth, TensorFlow warned of "excessive retracing" in every tracked run of a Keras project."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    example = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        with start_tracking(EVERY_CHECKPOINT, rank=0, world_size=1, framework="tensorflow", strategy="data",
                            project_name="keras") as tracker:
            for epoch in range(1, 7):
                tracker.log_metrics({"val_acc": 0.1 * epoch}, step=epoch)
                tracker.log_model(model, input_example=example, name=f"checkpoint-{epoch}", step=epoch,
                                  checkpoint=True)
            run_id = tracker.run_id
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    client = mlflow.MlflowClient(settings.embedded_uri(tmp_path))
    logged = client.search_logged_models(experiment_ids=[client.get_run(run_id).info.experiment_id])
    assert sorted(m.name for m in logged) == [f"checkpoint-{epoch}" for epoch in range(1, 7)]
    assert [r.getMessage()[:80] for r in seen if "retracing" in r.getMessage()] == []


class Unclonable(keras.Model):
    """A subclassed model with no get_config: Keras cannot clone it."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_keras_checkpoint_is_that_epochs_model_or_its_metrics_alone(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    unclonable = Unclonable()
    example = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    unclonable(example)
    before = np.asarray(model(example))
    with start_tracking(EVERY_CHECKPOINT, rank=0, world_size=1, framework="tensorflow", strategy="data",
                        project_name="keras") as tracker:
        tracker.log_metrics({"val_acc": 0.5}, step=1)
        tracker.log_model(model, input_example=example, name="checkpoint-1", step=1, checkpoint=True)
        model.set_weights([w + 1.0 for w in model.get_weights()])  # training goes on
        for step in (1, 2):
            tracker.log_metrics({"sub_acc": 0.1 * step}, step=step)
            tracker.log_model(unclonable, input_example=example, name=f"sub-{step}", step=step, checkpoint=True)
        run_id = tracker.run_id
    uri = settings.embedded_uri(tmp_path)
    client = mlflow.MlflowClient(uri)
    (logged,) = client.search_logged_models(experiment_ids=[client.get_run(run_id).info.experiment_id])
    assert logged.name == "checkpoint-1" and [(m.key, m.step) for m in logged.metrics] == [("val_acc", 1)]
    mlflow.set_tracking_uri(uri)
    try:
        loaded = mlflow.tensorflow.load_model(f"models:/{logged.model_id}")
        np.testing.assert_allclose(np.asarray(loaded(example)), before, rtol=1e-5)
    finally:
        mlflow.set_tracking_uri(None)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "sub_acc")] == [(1, 0.1), (2, 0.2)]
    warned = [r.getMessage() for r in caplog.records if r.name == "hvd_runtime.tracking" and r.levelname == "WARNING"]
    assert len(warned) == 1 and "cannot be cloned" in warned[0]
