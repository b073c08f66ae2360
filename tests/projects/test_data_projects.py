"""A freshly generated data-parallel project, torch and TensorFlow alike, trains under horovodrun -np 2,
resumes, and tracks one MLflow run from rank 0 only. (Its own tests run through `make test` in
test_documented_commands.py, for every shape.)"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import importing, python_command, run_horovod

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow
NO_TF = importlib.util.find_spec("tensorflow") is None
FRAMEWORKS = ["torch", pytest.param("tensorflow", marks=pytest.mark.skipif(
    NO_TF, reason="TensorFlow is not installed: the TF project is not tested here"))]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def project(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("gen")
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "demo", "--framework", request.param,
                    "--output", str(out)], check=True)
    return request.param, out / "demo"


def metrics(ranks: Path) -> list[dict]:
    return [json.loads(line) for line in (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()]


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@pytest.mark.timeout(900)
@pytest.mark.plain_start   # data parallelism's ranks start as users start them, a cold interpreter each
def test_trains_resumes_and_only_rank0_writes(project, tmp_path):
    _, path = project
    ranks = tmp_path / "ranks"
    launch = [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(path), str(ranks)]

    first = run_horovod(2, [*launch, "--train.epochs", "4"], cwd=path, env=importing(path), timeout=400)
    history = metrics(ranks)
    assert [m["epoch"] for m in history] == [1, 2, 3, 4]
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"], "the loss should fall"
    assert len(set(json.loads((ranks / "digests.json").read_text()))) == 1, "ranks' parameters differ"
    assert files_under(ranks / "rank1") == [], "rank 1 must not write anything"
    assert len(list((ranks / "rank0" / "checkpoints").glob("ckpt-*"))) == 3  # keep = 3
    assert "resuming" not in first.stdout

    second = run_horovod(2, [*launch, "--train.epochs", "12"], cwd=path, env=importing(path), timeout=400)
    assert "resuming from" in second.stdout and "epoch 4" in second.stdout
    history = metrics(ranks)
    assert [m["epoch"] for m in history] == list(range(1, 13)), "epochs go on from where they stopped"
    assert history[4]["step"] > history[3]["step"]
    assert history[-1]["val_accuracy"] >= 0.90
    assert len(set(json.loads((ranks / "digests.json").read_text()))) == 1
    assert files_under(ranks / "rank1") == []

    # Tracking: one MLflow run in rank 0's embedded store, continued by the resumed job.
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{ranks / 'rank0' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["world_size"] == "2"
    logged_epochs = [m.value for m in client.get_metric_history(run.info.run_id, "epoch")]
    assert sorted(logged_epochs) == list(range(1, 13)), "each epoch logged once, all in the same run"


@pytest.mark.parametrize("override, message", [
    (["--optim.name", "lamb"], "config error: optim.name is 'lamb': choose one of sgd, adam, adamw"),
    (["--train.epoch", "3"], "config error: unknown config key train.epoch: valid keys are batch_size, compile, "
                             "epochs, eval_batch_size, grace_s, hang_allowance_s, hang_timeout_s, log_every, "
                             "max_skipped, on_nonfinite, precision"),
    (["--horovod.threads_per_rank", "-2"], "config error: horovod.threads_per_rank must be 0 or more, got -2"),
])
def test_bad_config_stops_with_one_line(project, tmp_path, override, message):
    _, path = project
    proc = subprocess.run(python_command([sys.executable, str(path / "train.py"), *override]), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    # The last line is ours; TensorFlow may log its own start-up lines before it.
    assert proc.stderr.strip().splitlines()[-1] == message and proc.stderr.count("config error") == 1
    assert list(tmp_path.iterdir()) == [], "nothing written"
