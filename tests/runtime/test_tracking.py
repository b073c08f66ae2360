"""hvd_runtime.tracking in one process: the embedded store, a dead and a hung server, replay, resume."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")
torch = pytest.importorskip("torch")
from mlflow import MlflowClient  # noqa: E402

from hvd_runtime.config import load_config  # noqa: E402
from hvd_runtime.tracking import Tracker, settings, start_tracking  # noqa: E402
from hvd_runtime.tracking.spool import read_segments  # noqa: E402

WARNING_MARK = "training continues, unsent tracking data goes to"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Each test in its own working dir, with MLflow's process-wide settings put back afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in (*settings.HTTP_DEFAULTS, "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(key, raising=False)
    yield
    mlflow.set_tracking_uri(None)


def start(project: str, **kwargs) -> Tracker:
    config = load_config(overrides=kwargs.pop("overrides", []))
    tracker = start_tracking(config, rank=0, world_size=2, framework="torch", strategy="data",
                             project_name=project, **kwargs)
    assert isinstance(tracker, Tracker)
    return tracker


def dead_uri() -> str:
    with socket.socket() as s:          # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def tracking_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "hvd_runtime.tracking" and r.levelno == logging.WARNING]


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def only_run(client: MlflowClient, experiment: str):
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return runs[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_embedded_store_holds_params_metrics_artifacts_and_a_loadable_model(tmp_path):
    model, example = tiny_model(), torch.randn(2, 4)
    Path("notes.txt").write_text("hello")
    with start("embedded", overrides=["tracking.checkpoint_models=every"]) as tracker:
        for step in range(3):
            tracker.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
        tracker.set_tags({"stage": "test"})
        tracker.log_artifact("notes.txt")
        first = model(example).detach()
        tracker.log_metrics({"val_acc": 0.5}, step=10)    # an epoch's metrics, then its checkpoint
        tracker.log_model(model, input_example=example, name="checkpoint-1", step=10, checkpoint=True)
        with torch.no_grad():   # training goes on while the checkpoint waits in the queue
            model[0].weight.add_(1.0)
        tracker.log_metrics({"val_acc": 0.75}, step=20)
        tracker.log_model(model, input_example=example, name="checkpoint-2", step=20, checkpoint=True)
        run_id = tracker.run_id
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = only_run(client, "embedded")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "2" and run.data.tags["stage"] == "test"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0, 1, 2]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_acc")] == [(10, 0.5), (20, 0.75)], \
        "logged once, on the run; MLflow links them to the model of their step"
    assert [a.path for a in client.list_artifacts(run_id)] == ["notes.txt"]
    best, older = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                              order_by=[{"field_name": "metrics.val_acc", "ascending": False}])
    assert (best.name, older.name) == ("checkpoint-2", "checkpoint-1")
    assert [(m.key, m.step, m.value) for m in older.metrics] == [("val_acc", 10, 0.5)]
    # models:/ URIs resolve against MLflow's global store: this one, by its absolute path (the default,
    # sqlite:///mlflow.db, is relative, and MLflow keeps the store an earlier test opened under it)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    loaded = mlflow.pytorch.load_model(f"models:/{best.model_id}")
    assert torch.allclose(loaded(example), model(example))
    assert torch.allclose(mlflow.pytorch.load_model(f"models:/{older.model_id}")(example), first), \
        "each checkpoint's LoggedModel holds the weights it had when logged"
    signature = mlflow.models.get_model_info(f"models:/{best.model_id}").signature
    assert list(signature.inputs.to_dict()[0]["tensor-spec"]["shape"]) == [-1, 4]
    model_dir = Path(mlflow.artifacts.download_artifacts(f"models:/{best.model_id}", dst_path=str(tmp_path / "dl")))
    assert f"torch=={torch.__version__.split('+')[0]}\n" in (model_dir / "requirements.txt").read_text(), \
        "pinned as PyPI serves it, without a local label such as +cpu"
    assert not (tmp_path / "runs").exists()     # nothing failed, so nothing was spooled


def test_a_local_version_label_leaves_the_pin_without_a_warning():
    """A CPU torch (2.13.0+cpu) is pinned as torch==2.13.0, which installs from PyPI; MLflow's note
    that it dropped the label would otherwise be a warning in every tracked run of such a torch."""
    import mlflow.pytorch

    from hvd_runtime.tracking import sink

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    notes = logging.getLogger("mlflow.utils.requirements_utils")
    notes.addHandler(handler)
    try:
        requirements = sink._requirements.__wrapped__(mlflow.pytorch)   # past the per-process cache
    finally:
        notes.removeHandler(handler)
    assert f"torch=={torch.__version__.split('+')[0]}" in requirements, requirements
    assert [record.getMessage() for record in seen] == []


def test_auto_skips_checkpoints_of_short_epochs_and_logs_the_final_model(tmp_path):
    """At the default tracking.checkpoint_models (auto), checkpoints a few seconds apart are not
    worth a model each (tracker.checkpoint_model_due); the final model always is, and its
    logging time is what the next decision would weigh."""
    model, example = tiny_model(), torch.randn(2, 4)
    with start("auto") as tracker:
        for epoch in (1, 2, 3):
            tracker.log_metrics({"val_acc": 0.1 * epoch}, step=epoch)
            tracker.log_model(model, input_example=example, name=f"checkpoint-{epoch}", step=epoch, checkpoint=True)
        tracker.log_model(model, input_example=example, step=3)
        sender = tracker._sender
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = only_run(client, "auto")
    assert [m.name for m in client.search_logged_models(experiment_ids=[run.info.experiment_id])] == ["model"]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val_acc")] == pytest.approx([0.1, 0.2, 0.3])
    assert sender.models_done == 1 and sender.model_seconds > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_unreachable_server_warns_once_spools_everything_and_replays(tmp_path, caplog):
    uri = dead_uri()
    model, example = tiny_model(), torch.randn(2, 4)
    tracker = start("offline", tracking_uri=uri, overrides=["tracking.checkpoint_models=every"])
    for step in range(200):
        tracker.log_metrics({"train/loss": float(step)}, step=step)
    tracker.set_tags({"stage": "offline"})
    tracker.log_metrics({"val_acc": 0.25}, step=199)
    tracker.log_model(model, input_example=example, name="checkpoint-1", step=199, checkpoint=True)
    tracker.close()
    assert tracker.run_id is None
    warnings = tracking_warnings(caplog)
    assert len(warnings) == 1 and WARNING_MARK in warnings[0] and uri in warnings[0]

    spool = tmp_path / "runs" / "latest" / "mlflow-spool"
    ((header, items),) = list(read_segments(spool / "spool.jsonl"))
    assert header["experiment"] == "offline"
    assert [r["step"] for r in items if r["kind"] == "metrics" and "train/loss" in r["metrics"]] == list(range(200))
    assert [r["kind"] for r in items if r["kind"] != "metrics"] == ["params", "tags", "model", "end"]

    target = f"sqlite:///{tmp_path / 'replayed.db'}"
    replay = subprocess.run([sys.executable, "-m", "hvd_runtime.tracking.replay", str(spool), "--uri", target],
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-3000:]
    client = MlflowClient(target)
    run = only_run(client, "offline")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(200))
    (logged,) = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    linked = {m.key: (m.step, m.value) for m in logged.metrics}
    assert logged.name == "checkpoint-1" and linked["val_acc"] == (199, 0.25), \
        "a spooled checkpoint keeps its step and metrics through the replay"
    mlflow.set_tracking_uri(target)               # models:/ URIs resolve against the global store
    assert torch.allclose(mlflow.pytorch.load_model(f"models:/{logged.model_id}")(example), model(example))
    assert (spool / "spool.replayed.jsonl").exists() and not (spool / "spool.jsonl").exists()


class HungServer:
    """A TCP peer that accepts connections and never answers until closed: the worst kind of server."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.contacted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return
            self.contacted.set()

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def hung(monkeypatch):
    """A hung server, with MLflow told to wait on it for an hour: nothing but closing it frees the sender."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3600")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = HungServer()
    yield server
    server.close()


@pytest.mark.timeout(120)   # a call that waits on the server would hang here
def test_logging_returns_while_the_server_holds_the_sender(tmp_path, caplog, hung):
    tracker = start("held", tracking_uri=hung.uri)
    assert hung.contacted.wait(60), "the sender never reached the server"
    for step in range(200):     # each call returns although the server has answered nothing
        tracker.log_metrics({"train/loss": float(step)}, step=step)
    sender = tracker._sender
    assert not sender.ready.is_set() and sender.is_alive()     # still waiting for the run to open
    assert sender.queue.qsize() == 200 and not tracking_warnings(caplog)
    hung.close()                # the server goes away: the sender fails, warns once and spools it all
    tracker.close()
    assert len(tracking_warnings(caplog)) == 1
    ((header, items),) = list(read_segments(tmp_path / "runs" / "latest" / "mlflow-spool" / "spool.jsonl"))
    assert [r["step"] for r in items if r["kind"] == "metrics" and "train/loss" in r["metrics"]] == list(range(200))
    assert items[-1]["kind"] == "end"


@pytest.mark.timeout(120)   # a call that waits on the server would hang here
def test_close_gives_up_on_a_hung_server_after_its_timeout_and_spools_the_rest(tmp_path, caplog, hung):
    tracker = start("hung", tracking_uri=hung.uri)
    for step in range(5):
        tracker.log_metrics({"train/loss": float(step)}, step=step)
    tracker.close(timeout=1)
    # close returned on its own timeout, while the tracking process still waited for the server (as it
    # would for an hour), and ended that process: nothing of the run is left waiting
    sender = tracker._sender
    assert sender.sink is not None and sender.sink._process.poll() is not None
    assert sender.ready.wait(30) and sender.run_id is None    # the sender let go of the run it never opened
    (warning,) = tracking_warnings(caplog)
    assert "did not finish within" in warning and WARNING_MARK in warning
    ((header, items),) = list(read_segments(tmp_path / "runs" / "latest" / "mlflow-spool" / "spool.jsonl"))
    assert [r["step"] for r in items if r["kind"] == "metrics"] == list(range(5))
    assert items[-1]["kind"] == "end"


@pytest.mark.timeout(600)
def test_resume_continues_the_run_and_names_changed_params(tmp_path):
    with start("resume", overrides=["train.epochs=1"]) as tracker:
        tracker.log_metrics({"loss": 1.0}, step=0)
        first = tracker.run_id
    with start("resume", overrides=["train.epochs=3"], run_id=first) as tracker:
        tracker.log_metrics({"loss": 0.5}, step=1)
        assert tracker.run_id == first
    client = MlflowClient(settings.embedded_uri(tmp_path))
    run = only_run(client, "resume")
    assert [m.step for m in client.get_metric_history(first, "loss")] == [0, 1]
    assert run.data.params["train.epochs"] == "1"
    assert run.data.tags["hvd_runtime.params_changed"] == "train.epochs"
    assert run.info.status == "FINISHED"


@pytest.mark.timeout(600)
def test_a_run_id_unknown_to_the_store_starts_a_new_run_that_names_it(tmp_path):
    with start("moved", run_id="0123456789abcdef0123456789abcdef") as tracker:
        run_id = tracker.run_id
    run = MlflowClient(settings.embedded_uri(tmp_path)).get_run(run_id)
    assert run_id != "0123456789abcdef0123456789abcdef"
    assert run.data.tags["hvd_runtime.original_run_id"] == "0123456789abcdef0123456789abcdef"


@pytest.mark.timeout(600)
def test_a_bad_model_or_value_is_reported_never_raised(caplog):
    with start("bad") as tracker:
        tracker.log_model(object(), input_example=None)
        tracker.log_metrics({"loss": "not a number"}, step=0)
        tracker.log_artifact("no-such-file.yaml")   # e.g. a file only the lost rank 0 had
        tracker.log_metrics({"loss": 1.0}, step=1)
        run_id = tracker.run_id
    messages = tracking_warnings(caplog)
    assert len(messages) == 3 and all(m.startswith("tracking call ignored") for m in messages)
    assert "no artifact at no-such-file.yaml" in messages[2]
    client = MlflowClient(settings.embedded_uri(Path.cwd()))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]


@pytest.mark.timeout(600)
def test_an_elastic_jobs_new_rank0_takes_over_the_run(tmp_path):
    """start_tracking(elastic=True): a HandoverTracker on every rank; the rank that becomes rank 0
    after a reset logs on, into the run the job's first rank 0 opened."""
    config = load_config()
    common = dict(framework="torch", strategy="data", project_name="handover", elastic=True)
    first = start_tracking(config, rank=0, world_size=3, **common)
    second = start_tracking(config, rank=1, world_size=3, **common)
    assert first.tracking and not second.tracking and second.opened_run_id() is None
    first.log_metrics({"loss": 1.0}, step=0)
    run_id = first.run_id
    assert first.opened_run_id() == run_id
    first.close()                      # (a lost rank 0 ends nothing; here its store must be released)
    second.follow(1, 2, run_id)        # not rank 0: still nothing
    assert not second.tracking
    second.follow(0, 2, run_id)        # rank 0 now
    with second:
        second.log_metrics({"loss": 0.5, "world_size": 2}, step=1)
    client = MlflowClient(settings.embedded_uri(tmp_path))
    run = only_run(client, "handover")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1]
    assert run.data.params["world_size"] == "3" and run.data.tags["hvd_runtime.params_changed"] == "world_size"


@pytest.mark.timeout(600)
def test_a_rejected_record_is_dropped_alone_and_the_run_goes_on(tmp_path, caplog):
    with start("rejected") as tracker:
        tracker.log_metrics({"loss": 1.0}, step=0)
        tracker.log_metrics({"loss": 0.9, "bad key!": 1.0}, step=1)
        tracker.log_metrics({"loss": 0.8}, step=2)
        run_id = tracker.run_id
    client = MlflowClient(settings.embedded_uri(tmp_path))
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 2]
    assert client.get_run(run_id).info.status == "FINISHED"
    (message,) = tracking_warnings(caplog)
    assert message.startswith("MLflow rejected a metrics record")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replay_into_a_store_that_has_the_run_continues_it(tmp_path):
    from hvd_runtime.tracking import records
    from hvd_runtime.tracking.spool import Spool

    with start("back") as tracker:
        tracker.log_metrics({"loss": 1.0}, step=0)
        run_id = tracker.run_id
    uri = settings.embedded_uri(tmp_path)
    head = [{"kind": "run", "experiment": "back", "run_id": run_id, "run_name": "x", "tags": {}, "start_time": 0},
            records.params({"world_size": "2"})]
    spool = Spool(tmp_path / "spool", lambda: head)
    spool.write([records.metrics({"loss": 0.5}, step=1), records.metrics({"loss": 0.25}, step=2)])
    replay = subprocess.run([sys.executable, "-m", "hvd_runtime.tracking.replay", str(spool.path), "--uri", uri],
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-3000:]
    client = MlflowClient(uri)
    run = only_run(client, "back")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"   # not reopened, not renamed
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replay_that_stops_part_way_resumes_where_it_stopped(tmp_path):
    from hvd_runtime.tracking import records
    from hvd_runtime.tracking.spool import Spool

    head = [{"kind": "run", "experiment": "partial", "run_id": None, "run_name": "x", "tags": {}, "start_time": 0},
            records.params({"world_size": "2"})]
    spool = Spool(tmp_path / "spool", lambda: head)
    spool.write([records.metrics({"loss": 1.0}, step=0), records.end("FINISHED")])
    lines = spool.path.read_text().splitlines()   # an artifact that is not there (yet) stops the replay
    lines.insert(3, json.dumps(records.artifact("late.txt")))
    spool.path.write_text("\n".join(lines) + "\n")
    uri = f"sqlite:///{tmp_path / 'target.db'}"
    command = [sys.executable, "-m", "hvd_runtime.tracking.replay", str(spool.directory), "--uri", uri]

    stopped = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 1 and "replay stopped" in stopped.stderr
    ((header, left),) = list(read_segments(spool.path))
    assert header["run_id"] and [r["kind"] for r in left] == ["artifact", "end"]

    (spool.directory / "late.txt").write_text("here now")
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client = MlflowClient(uri)
    run = only_run(client, "partial")
    assert run.info.run_id == header["run_id"] and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0]   # sent once
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["late.txt"]


@pytest.mark.timeout(120)   # a call that waits on the server would hang here
def test_a_full_queue_spools_instead_of_blocking_the_loop(tmp_path, hung):
    from hvd_runtime.tracking import records
    from hvd_runtime.tracking.sender import Sender
    from hvd_runtime.tracking.spool import Spool

    problems: list[str] = []    # the sender is stuck opening the run, so nothing leaves the queue
    header = {"kind": "run", "experiment": "full", "run_id": None, "tags": {}, "start_time": 0}
    sender = Sender(hung.uri, header, records.params({}), None, problems.append, queue_size=3)
    sender.spool = Spool(tmp_path / "spool", sender.segment_head)
    sender.start()
    assert hung.contacted.wait(60), "the sender never reached the server"
    for step in range(10):      # a blocking put would wait here for as long as the server hangs
        sender.submit(records.metrics({"loss": 1.0}, step))
    assert not sender.ready.is_set()            # the server has still answered nothing
    assert sender.queue.qsize() == 3
    ((_, items),) = list(read_segments(sender.spool.path))
    assert problems and "behind" in problems[0]
    assert [r["step"] for r in items if r["kind"] == "metrics"] == list(range(3, 10))


@pytest.mark.timeout(600)
def test_a_deleted_run_is_not_resumed(tmp_path):
    with start("deleted") as tracker:
        first = tracker.run_id
    client = MlflowClient(settings.embedded_uri(tmp_path))
    client.delete_run(first)
    with start("deleted", run_id=first) as tracker:
        tracker.log_metrics({"loss": 1.0}, step=0)
        second = tracker.run_id
    assert second != first
    assert client.get_run(second).data.tags["hvd_runtime.original_run_id"] == first
    assert [m.step for m in client.get_metric_history(second, "loss")] == [0]
