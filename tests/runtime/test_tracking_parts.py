"""The framework-free parts of hvd_runtime.tracking: where it logs, what a run records, the spool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_runtime.config import RunConfig, load_config
from hvd_runtime.tracking import NullTracker, start_tracking
from hvd_runtime.tracking import params as run_facts
from hvd_runtime.tracking import records, settings
from hvd_runtime.tracking.spool import Spool, read_segments


def test_uri_precedence_argument_then_env_then_config_then_embedded(monkeypatch, tmp_path):
    config = load_config(overrides=["tracking.uri=http://from-config:5000"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-env:5000")
    assert settings.resolve_uri("http://explicit:5000", config) == "http://explicit:5000"
    assert settings.resolve_uri(None, config) == "http://from-env:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert settings.resolve_uri(None, config) == "http://from-config:5000"
    assert settings.resolve_uri(None, RunConfig(), cwd=tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"


def test_experiment_defaults_to_the_project_name():
    assert settings.experiment_name(RunConfig(), "demo") == "demo"
    assert settings.experiment_name(load_config(overrides=["tracking.experiment=team-a"]), "demo") == "team-a"


def test_http_defaults_never_override_the_user(monkeypatch):
    environ = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}
    settings.apply_http_defaults(environ)
    assert environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"
    assert environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == settings.HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]


def test_params_hold_the_whole_config_the_job_and_the_versions(tmp_path):
    config = load_config(overrides=["optim.lr=0.2", "model.hidden=[8, 4]"])
    params = run_facts.run_params(config, world_size=4, strategy="data", framework="torch", cwd=tmp_path)
    assert {key: params[key] for key in run_facts.flatten(config)} == {
        key: str(value) for key, value in run_facts.flatten(config).items()}
    assert params["optim.lr"] == "0.2" and params["model.hidden"] == "[8, 4]"
    assert (params["world_size"], params["strategy"], params["framework"]) == ("4", "data", "torch")
    assert params["horovod_version"] and params["torch_version"] and params["mlflow_version"]
    assert "git_commit" not in params        # tmp_path is not in a repository


def test_git_commit_is_recorded_inside_a_repository(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    params = run_facts.run_params(RunConfig(), world_size=1, strategy="data", framework="torch", cwd=tmp_path)
    assert params["git_commit"] == head
    assert run_facts.run_tags(params)["mlflow.source.git.commit"] == head


def test_passwords_in_uris_are_not_logged():
    assert run_facts.redact("https://bob:s3cret@mlflow.example:443/x") == "https://bob:***@mlflow.example:443/x"
    assert run_facts.redact("https://mlflow.example") == "https://mlflow.example"
    config = load_config(overrides=["tracking.uri=http://bob:s3cret@host:5000"])
    params = run_facts.run_params(config, world_size=1, strategy="data", framework="torch")
    assert "s3cret" not in json.dumps(params)


def test_consecutive_metrics_share_one_request_and_other_records_stand_alone():
    batch = [records.metrics({"a": 1}, 0), records.metrics({"a": 2}, 1), records.tags({"t": 1}),
             records.metrics({"a": 3}, 2), records.end("FINISHED")]
    assert [[r["kind"] for r in g] for g in records.group(batch)] == [
        ["metrics", "metrics"], ["tags"], ["metrics"], ["end"]]
    wide = [records.metrics({f"k{i}": i for i in range(600)}, s) for s in range(2)]
    assert len(records.group(wide)) == 2      # one log_batch holds at most 1000 metrics


def test_spool_starts_each_segment_with_its_run_and_copies_artifacts(tmp_path):
    artifact = tmp_path / "checkpoint.pt"
    artifact.write_text("weights")
    head = [{"kind": "run", "experiment": "e", "run_id": "abc"}, records.params({"world_size": "2"})]
    spool = Spool(tmp_path / "spool", lambda: head)
    spool.write([records.metrics({"loss": 1.0}, 0), records.artifact(str(artifact))])
    artifact.unlink()                         # e.g. rotated away by keep-K before anyone replays
    Spool(tmp_path / "spool", lambda: head).write([records.end("FINISHED")])
    segments = list(read_segments(spool.path))
    assert [h["run_id"] for h, _ in segments] == ["abc", "abc"]
    first = segments[0][1]
    assert [r["kind"] for r in first] == ["params", "metrics", "artifact"]
    assert (spool.directory / first[2]["path"]).read_text() == "weights"
    assert not Path(first[2]["path"]).is_absolute()


def test_other_ranks_do_nothing_and_never_import_mlflow(tmp_path):
    code = """
import sys
from hvd_runtime.config import RunConfig
from hvd_runtime.tracking import start_tracking
with start_tracking(RunConfig(), rank=1, world_size=2, framework="torch", strategy="data",
                    project_name="p", tracking_uri="http://127.0.0.1:9") as tracker:
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.set_tags({"a": "b"})
    tracker.log_artifact("nothing-here")
    tracker.log_model(object(), input_example=None)
assert tracker.run_id is None
assert "mlflow" not in sys.modules, "mlflow imported on rank 1"
"""
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120)
    assert list(tmp_path.iterdir()) == []     # rank 1 wrote nothing


def test_tracking_can_be_switched_off_in_the_config():
    config = load_config(overrides=["tracking.enabled=false"])
    tracker = start_tracking(config, rank=0, world_size=1, framework="torch", strategy="data", project_name="p")
    assert isinstance(tracker, NullTracker) and tracker.run_id is None


def test_replay_without_a_spool_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvd_runtime.tracking.replay", str(tmp_path), "--uri",
                           f"sqlite:///{tmp_path}/x.db"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "nothing to replay" in proc.stderr


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch):
    """start_tracking sets MLflow's HTTP defaults in os.environ; keep them out of other tests."""
    for key in settings.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)


def test_checkpoint_models_auto_keeps_logging_to_a_tenth_of_the_run():
    from hvd_runtime.tracking.tracker import FIRST_MODEL_SECONDS, checkpoint_model_due as due

    assert due("every", in_flight=True, since=0.0, last_cost=50.0)
    assert not due("final", in_flight=False, since=1e9, last_cost=0.0)
    # before any model was logged, the first is assumed to cost FIRST_MODEL_SECONDS
    assert not due("auto", in_flight=False, since=9 * FIRST_MODEL_SECONDS - 0.1, last_cost=None)
    assert due("auto", in_flight=False, since=9 * FIRST_MODEL_SECONDS, last_cost=None)
    # then what the last one took: 0.8 s to log is worth it 7.2 s later, not sooner
    assert not due("auto", in_flight=False, since=7.1, last_cost=0.8)
    assert due("auto", in_flight=False, since=7.2, last_cost=0.8)
    assert not due("auto", in_flight=True, since=1e9, last_cost=0.8), "never two at once"
    with pytest.raises(Exception, match="tracking.checkpoint_models is 'sometimes': choose one of auto, every, final"):
        load_config(overrides=["tracking.checkpoint_models=sometimes"])
