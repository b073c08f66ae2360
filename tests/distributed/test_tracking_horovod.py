"""hvd_runtime.tracking under a real `horovodrun -np 2`, against a real `mlflow server`.

Each test launches tests/distributed/scripts/tracked_training.py, which tracks like a generated
train.py (DistributedOptimizer, losses averaged with hvd.allreduce, metrics per step and per epoch,
checkpoint artifact, log_model at the end), then reads the server back with MlflowClient.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import MlflowServer, run_horovod

mlflow = pytest.importorskip("mlflow")
torch = pytest.importorskip("torch")
from mlflow import MlflowClient  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "tracked_training.py"
STEPS_PER_EPOCH = 8          # 256 samples / 2 ranks / batch 16, as in the script
WARNING_MARK = "training continues, unsent tracking data goes to"
JOB_TIMEOUT = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    yield running
    running.kill()


def launch(workdir: Path, project: str, env: dict, *extra: str, check: bool = True):
    return run_horovod(2, ["python", str(SCRIPT), "--workdir", str(workdir), "--project", project, *extra],
                       cwd=workdir, env=env, timeout=JOB_TIMEOUT, check=check)


def only_run(client: MlflowClient, experiment: str):
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"expected exactly one run, got {len(runs)}"
    return runs[0]


def steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def assert_model_predicts(client: MlflowClient, run) -> None:
    models = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    mlflow.set_tracking_uri(client.tracking_uri)   # models:/ URIs resolve against the global store
    assert [m.source_run_id for m in models] == [run.info.run_id]
    model = mlflow.pytorch.load_model(f"models:/{models[0].model_id}")
    assert model(torch.randn(4, 8)).shape == (4, 3)
    assert mlflow.models.get_model_info(f"models:/{models[0].model_id}").signature is not None


def warnings_in(proc) -> int:
    return (proc.stdout + proc.stderr).count(WARNING_MARK)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_run_per_job_on_a_real_server(server, tmp_path):
    proc = launch(tmp_path, "live", {"MLFLOW_TRACKING_URI": server.uri})
    client = MlflowClient(server.uri)
    run = only_run(client, "live")
    params = run.data.params
    assert params["world_size"] == "2"
    assert (params["framework"], params["strategy"]) == ("torch", "data")
    assert params["train.epochs"] == "2" and "optim.lr" in params and params["horovod_version"]
    assert steps(client, run.info.run_id, "train/loss") == list(range(2 * STEPS_PER_EPOCH))
    assert steps(client, run.info.run_id, "val/accuracy") == [0, 1]
    assert run.info.status == "FINISHED"
    assert "checkpoint.pt" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert_model_predicts(client, run)
    assert warnings_in(proc) == 0
    assert not (tmp_path / "run" / "mlflow-spool").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_resumed_job_logs_into_the_same_run(server, tmp_path):
    env = {"MLFLOW_TRACKING_URI": server.uri}
    launch(tmp_path, "resume", env, "--epochs", "1")
    first_id = torch.load(tmp_path / "checkpoint.pt")["run_id"]
    launch(tmp_path, "resume", env, "--epochs", "2")
    client = MlflowClient(server.uri)
    run = only_run(client, "resume")
    assert run.info.run_id == first_id == torch.load(tmp_path / "checkpoint.pt")["run_id"]
    assert steps(client, first_id, "train/loss") == list(range(2 * STEPS_PER_EPOCH))
    assert steps(client, first_id, "val/accuracy") == [0, 1]
    assert run.data.params["train.epochs"] == "1"                       # params are write-once
    assert run.data.tags["hvd_runtime.params_changed"] == "train.epochs"
    assert run.info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dead_server_mid_run_spools_and_replays(server, tmp_path):
    doomed = MlflowServer(tmp_path / "doomed")
    workdir = tmp_path / "job"
    workdir.mkdir()
    pause = STEPS_PER_EPOCH // 2
    result: dict = {}

    def job():
        result["proc"] = launch(workdir, "dead", {"MLFLOW_TRACKING_URI": doomed.uri},
                                "--pause-at-step", str(pause), check=False)

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not (workdir / "paused").exists():
            assert thread.is_alive() and time.monotonic() < deadline, "the job never reached the pause"
            time.sleep(0.2)
        client = MlflowClient(doomed.uri)
        while True:  # metrics are sent in order: once step `pause` is there, all before it are
            experiment = client.get_experiment_by_name("dead")
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            if runs and pause in steps(client, runs[0].info.run_id, "train/loss"):
                break
            assert time.monotonic() < deadline, "the first metrics never reached the server"
            time.sleep(0.5)
        assert steps(client, runs[0].info.run_id, "train/loss") == list(range(pause + 1))
    finally:
        doomed.kill()
        (workdir / "resume").touch()
    killed_at = time.monotonic()
    thread.join(JOB_TIMEOUT)
    proc = result["proc"]
    print(f"job finished {time.monotonic() - killed_at:.1f} s after the server was killed")
    print("\n".join(line for line in proc.stdout.splitlines() if "mean step ms" in line))

    assert proc.returncode == 0, proc.stderr[-4000:]
    assert warnings_in(proc) == 1, proc.stderr[-4000:]
    spool = workdir / "run" / "mlflow-spool"
    assert (spool / "spool.jsonl").exists()

    replay = subprocess.run([sys.executable, "-m", "hvd_runtime.tracking.replay", str(spool), "--uri", server.uri],
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-4000:]
    client = MlflowClient(server.uri)
    run = only_run(client, "dead")
    assert run.data.params["world_size"] == "2"
    assert run.data.tags["hvd_runtime.original_run_id"] == runs[0].info.run_id
    replayed = steps(client, run.info.run_id, "train/loss")
    assert set(range(pause + 1, 2 * STEPS_PER_EPOCH)) <= set(replayed)
    assert len(replayed) == len(set(replayed))
    assert_model_predicts(client, run)
    assert (spool / "spool.replayed.jsonl").exists() and not (spool / "spool.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_embedded_store_without_a_server(tmp_path):
    launch(tmp_path, "embedded", {"MLFLOW_TRACKING_URI": ""})
    assert [p.name for p in tmp_path.glob("*.db")] == ["mlflow.db"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = only_run(client, "embedded")
    assert run.data.params["world_size"] == "2"
    assert steps(client, run.info.run_id, "train/loss") == list(range(2 * STEPS_PER_EPOCH))
    assert_model_predicts(client, run)
