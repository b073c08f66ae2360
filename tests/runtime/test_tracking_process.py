"""MLflow in a process of its own beside the training process (hvd_runtime/tracking/remote.py):
what crosses, what stays, and that the process never outlives or undermines the run."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")
torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")
from mlflow import MlflowClient  # noqa: E402

from hvd_runtime.config import load_config  # noqa: E402
from hvd_runtime.tracking import Tracker, settings, start_tracking  # noqa: E402
from hvd_runtime.tracking.replay import replay  # noqa: E402
from hvd_runtime.tracking.spool import read_segments  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

START = """
import os, signal, sys, time
from hvd_runtime.config import load_config
from hvd_runtime.tracking import start_tracking

def start(*overrides):
    return start_tracking(load_config(overrides=list(overrides)), rank=0, world_size=1, framework="torch",
                          strategy="data", project_name="process")
"""


def run_script(tmp_path: Path, body: str, **kwargs) -> subprocess.CompletedProcess:
    """`body` as a training script of its own started from a terminal, in tmp_path, tracked into
    tmp_path/mlflow.db."""
    script = tmp_path / "script.py"
    script.write_text(START + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env, **kwargs)


@pytest.fixture(autouse=True)
def _mlflow_settings_put_back():
    yield
    mlflow.set_tracking_uri(None)


def only_run(tmp_path: Path):
    """The client of tmp_path's store (models:/ URIs resolve there too) and its one run."""
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("process").experiment_id])
    return client, run


@pytest.mark.timeout(600)
def test_torch_models_are_logged_by_the_tracking_process(tmp_path):
    """MLflow never loads into a torch run's training process: each model, the epochs' checkpoints
    and the final one, crosses pickled, a class of the training script's own by value, and is
    logged as it was when logged (training goes on meanwhile)."""
    done = run_script(tmp_path, """
        import json, torch

        class Doubled(torch.nn.Module):     # the tracking process cannot import this module: by value
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 3)

            def forward(self, x):
                return 2 * self.linear(x)

        torch.manual_seed(0)
        model, example = Doubled(), torch.randn(2, 4)
        outputs = {}
        tracker = start("tracking.checkpoint_models=every")
        for epoch in (1, 2):
            tracker.log_metrics({"val_acc": 0.25 * epoch}, step=epoch)
            tracker.log_model(model, input_example=example, name=f"checkpoint-{epoch}", step=epoch, checkpoint=True)
            outputs[f"checkpoint-{epoch}"] = model(example).tolist()
            with torch.no_grad():               # training goes on while the checkpoint waits to be sent
                model.linear.weight.mul_(0.5)
        deadline = time.monotonic() + 240
        while tracker._sender.models_done < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tracker.log_model(model, input_example=example, step=2)
        outputs["model"] = model(example).tolist()
        tracker.close()
        print("mlflow loaded here:", "mlflow" in sys.modules)
        print(json.dumps({"example": example.tolist(), "outputs": outputs}))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "mlflow loaded here: False" in lines
    expected = json.loads(lines[-1])
    client, run = only_run(tmp_path)
    models = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    assert sorted(m.name for m in models) == ["checkpoint-1", "checkpoint-2", "model"]
    example = torch.tensor(expected["example"])
    for logged in models:
        got = mlflow.pytorch.load_model(f"models:/{logged.model_id}")(example)
        assert torch.allclose(got, torch.tensor(expected["outputs"][logged.name]), atol=1e-5), logged.name
    assert [(m.key, m.step) for m in next(m for m in models if m.name == "checkpoint-2").metrics] == [("val_acc", 2)]
    assert not (tmp_path / "runs").exists()     # nothing failed, so nothing was spooled


@pytest.mark.timeout(600)
def test_a_checkpoint_the_tracking_process_cannot_unpickle_is_logged_here(tmp_path):
    """A model class whose module the tracking process cannot import (here loaded from a file under
    a name of its own) is logged in the training process instead; the run goes on in the other."""
    hidden = tmp_path / "elsewhere" / "hidden_layers.py"
    hidden.parent.mkdir()
    hidden.write_text("import torch\n\nclass Hidden(torch.nn.Linear):\n    pass\n")
    done = run_script(tmp_path, f"""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("hidden_layers", {str(hidden)!r})
        hidden_layers = importlib.util.module_from_spec(spec)
        sys.modules["hidden_layers"] = hidden_layers
        spec.loader.exec_module(hidden_layers)
        model = hidden_layers.Hidden(4, 3)
        with start("tracking.checkpoint_models=every") as tracker:
            tracker.log_model(model, input_example=torch.randn(2, 4), name="checkpoint-1", step=1, checkpoint=True)
            tracker.log_metrics({{"loss": 0.5}}, step=2)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    client, run = only_run(tmp_path)
    (logged,) = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    assert logged.name == "checkpoint-1" and mlflow.pytorch.load_model(f"models:/{logged.model_id}") is not None
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.5]
    assert run.info.status == "FINISHED" and not (tmp_path / "runs").exists()


@pytest.mark.timeout(300)
def test_a_tracking_process_that_dies_is_a_failed_server_the_rest_is_spooled_and_replays(tmp_path, monkeypatch,
                                                                                          caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in settings.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    tracker = start_tracking(load_config(), rank=0, world_size=1, framework="torch", strategy="data",
                             project_name="process")
    assert isinstance(tracker, Tracker)
    tracker.log_metrics({"loss": 3.0}, step=0)
    run_id = tracker.run_id
    store = MlflowClient(settings.embedded_uri(tmp_path))
    deadline = time.monotonic() + 120
    while not store.get_metric_history(run_id, "loss") and time.monotonic() < deadline:
        time.sleep(0.05)    # step 0 stored: what follows is all the tracking process misses
    process = tracker._sender.sink._process
    process.kill()          # say the OOM killer picked it
    process.wait()
    for step in (1, 2):
        tracker.log_metrics({"loss": 3.0 - step}, step=step)
    tracker.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "hvd_runtime.tracking" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the tracking process ended" in warnings[0], warnings
    spool = tmp_path / "runs" / "latest" / "mlflow-spool"
    ((header, items),) = list(read_segments(spool / "spool.jsonl"))
    assert header["run_id"] == run_id
    assert [r["step"] for r in items if r["kind"] == "metrics"] == [1, 2] and items[-1]["kind"] == "end"
    assert replay(spool, settings.embedded_uri(tmp_path)) == [run_id]
    client, run = only_run(tmp_path)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1, 2]
    assert run.info.status == "FINISHED"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE     # ended; its parent has not reaped it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(300)
def test_the_tracking_process_ends_with_a_training_process_that_was_killed(tmp_path):
    done = run_script(tmp_path, """
        tracker = start()
        tracker.log_metrics({"loss": 1.0}, step=0)
        assert tracker.run_id
        print(tracker._sender.sink._process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 120
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the tracking process outlived the training process"


@pytest.mark.timeout(300)
def test_ctrl_c_ends_the_run_as_failed_through_the_tracking_process(tmp_path):
    """Ctrl-C reaches every process of the terminal's group, the tracking process too; it ignores
    it, so the training process can still end the run as FAILED, with the metrics before it."""
    done = run_script(tmp_path, """
        with start() as tracker:
            tracker.log_metrics({"loss": 1.0}, step=0)
            assert tracker.run_id
            os.killpg(os.getpgid(0), signal.SIGINT)     # as a terminal's Ctrl-C
            time.sleep(60)
    """, start_new_session=True)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr, done.stderr[-3000:]
    client, run = only_run(tmp_path)
    assert run.info.status == "FAILED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [1.0]
    assert not (tmp_path / "runs").exists()     # the run ended in the store, nothing spooled


def test_only_a_torch_model_held_in_host_memory_crosses():
    """What RemoteSink sends to the tracking process: a torch model whose tensors are in host
    memory, a checkpoint or the final one. Not a Keras model, nor one on a device (a GPU's tensors
    would open a CUDA context there; the meta device stands in for one here)."""
    from hvd_runtime.tracking.remote import RemoteSink

    def record(model, **changes):
        return [{"kind": "model", "flavor": "pytorch", "name": "m", "model": model, "step": 1, **changes}]

    on_cpu, elsewhere = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")
    assert RemoteSink._pickled_model("run", record(on_cpu)) is not None
    assert RemoteSink._pickled_model("run", record(elsewhere)) is None
    assert RemoteSink._pickled_model("run", record(on_cpu, flavor="tensorflow")) is None
