"""A freshly generated project, trained under horovodrun -np 2, tracked to a real `mlflow server`."""

import subprocess
import sys

import numpy as np
import pytest

from helpers import MlflowServer, run_horovod

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy", ["data", "pipeline"])
def test_generated_project_logs_one_run_to_a_server(tmp_path, strategy):
    import mlflow
    from mlflow import MlflowClient

    subprocess.run([sys.executable, "-m", "hvdgen", "new", "tracked", "--strategy", strategy,
                    "--output", str(tmp_path)], check=True)
    project = tmp_path / "tracked"
    server = MlflowServer(tmp_path / "server")
    try:
        # The data job runs as two hosts (each its own local rank 0), the pipeline on one.
        hosts = ["localhost", "127.0.0.1"] if strategy == "data" else ["localhost"]
        run_horovod(2, [sys.executable, "train.py", "--train.epochs", "3", "--train.log_every", "5",
                        "--horovod.threads_per_rank", "1", "--tracking.checkpoint_models", "every"], cwd=project, env={"MLFLOW_TRACKING_URI": server.uri},
                    timeout=600, hosts=",".join(f"{host}:{2 // len(hosts)}" for host in hosts))
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name("tracked")
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == 1, "one run per job, not one per rank"
        run = runs[0]
        assert run.data.params["world_size"] == "2" and run.data.params["strategy"] == strategy
        for key in ("epoch", "val_accuracy", "step_train_loss"):
            history = [m.step for m in client.get_metric_history(run.info.run_id, key)]
            assert history and len(history) == len(set(history)), f"{key} logged more than once per step"
        assert len(client.get_metric_history(run.info.run_id, "epoch")) == 3
        # MFU beside the throughput at each log point, and the epoch's
        assert {"mfu", "samples_per_s", "train_mfu"} <= set(run.data.metrics), sorted(run.data.metrics)
        assert all(0 < m.value < 1 for key in ("mfu", "train_mfu") for m in client.get_metric_history(run.info.run_id, key))
        system = {key for key in run.data.metrics if key.startswith("system/")}
        assert {key.split("/")[1] for key in system} == set(hosts), "every host's readings, in the one run"
        for host in hosts:
            cpu = client.get_metric_history(run.info.run_id, f"system/{host}/cpu_utilization_percentage")
            assert [m.step for m in cpu] == [m.step for m in client.get_metric_history(run.info.run_id, "epoch")]
            assert all(0.0 <= m.value <= 100.0 for m in cpu)
            assert f"system/{host}/system_memory_usage_megabytes" in system
        assert not (project / "mlflow.db").exists(), "the server, not the embedded store, got the run"

        models = client.search_logged_models(experiment_ids=[experiment.experiment_id],
                                             order_by=[{"field_name": "creation_timestamp", "ascending": True}])
        assert {m.source_run_id for m in models} == {run.info.run_id}
        epochs = client.get_metric_history(run.info.run_id, "epoch")
        # Each epoch's checkpoint is a LoggedModel (a pipeline's stages gathered whole), then the final model.
        assert [m.name for m in models] == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "model"]
        for logged, epoch in zip(models, epochs):
            linked = {m.key: m for m in logged.metrics}
            assert linked["epoch"].value == epoch.value and linked["val_accuracy"].step == epoch.step
        assert models[-1].metrics is None or all(m.step == epochs[-1].step for m in models[-1].metrics)
        mlflow.set_tracking_uri(server.uri)
        digits = np.random.default_rng(0).random((4, 64)).astype(np.float32)
        predictions = [np.asarray(mlflow.pyfunc.load_model(f"models:/{m.model_id}").predict(digits)) for m in models]
        assert all(p.shape == (4, 10) for p in predictions), "every LoggedModel loads and predicts"
        assert not np.allclose(predictions[0], predictions[2]), "each checkpoint holds its own epoch's weights"
        np.testing.assert_allclose(predictions[2], predictions[3], rtol=1e-5)  # the last one is the final model
    finally:
        mlflow.set_tracking_uri(None)
        server.kill()
