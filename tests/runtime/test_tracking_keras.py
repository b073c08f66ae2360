"""log_model for a Keras model: mlflow.tensorflow, signature from the example, loads and predicts.

Runs where TensorFlow is installed (the TF environment); skipped elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="Requires: tensorflow")
keras = pytest.importorskip("keras", reason="Requires: keras")
mlflow = pytest.importorskip("mlflow")

from hvd_runtime.config import RunConfig  # noqa: E402
from hvd_runtime.tracking import settings, start_tracking  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_keras_model_is_logged_with_the_tensorflow_flavor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    example = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    with start_tracking(RunConfig(), rank=0, world_size=1, framework="tensorflow", strategy="data",
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
