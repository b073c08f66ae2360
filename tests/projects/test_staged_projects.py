"""Generated model-split and pipeline projects train under horovodrun and only rank 0 writes."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import importing, python_command, run_horovod

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


# The 4-rank pipelines are the 2-stage projects' replicas line as their README shows it (default
# schedule, no options): test_documented_commands leaves that line to this test. One run is
# tracked (the default) and its MLflow store checked: a TensorFlow pipeline gathers its stages into
# the whole model for each LoggedModel (test_tracking_project checks the torch pipeline's). The
# others train untracked: MLflow's import, store and model logging cost each run about 15 CPU-s.
TRACKED = ("tensorflow", "pipeline", 2, ["--parallel.schedule", "gpipe"])
RUNS = [
    ("torch", "model-split", 2, ["--parallel.partition", "params"]),   # the default, time: test_documented_commands
    ("torch", "pipeline", 2, ["--parallel.schedule", "gpipe"]),
    ("torch", "pipeline", 2, []),                       # 1f1b, the default
    ("torch", "pipeline", 4, []),                       # 2 stages x 2 replicas
    ("tensorflow", "model-split", 2, ["--parallel.partition", "params"]),   # 2 logical CPU devices per worker
    TRACKED,
    ("tensorflow", "pipeline", 4, []),
]


@pytest.mark.parametrize("framework, strategy, np, extra", RUNS)
def test_staged_project_trains(tmp_path, framework, strategy, np, extra):
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--strategy", strategy,
                    "--output", str(tmp_path)], check=True)
    project, ranks = tmp_path / "proj", tmp_path / "ranks"
    epochs = 8 if np == 2 else 3
    env = {"SKIP_DIGEST": "1"} if strategy == "pipeline" else {}
    tracked = (framework, strategy, np, extra) == TRACKED
    proc = run_horovod(np, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
                            "--train.epochs", str(epochs), *extra,
                            # every epoch's checkpoint as a model, which "auto" thins on short epochs
                            *(["--tracking.checkpoint_models", "every"] if tracked else ["--tracking.enabled", "false"])],
                       cwd=project, env=env | importing(project), timeout=600)
    history = [json.loads(line) for line in (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == list(range(1, epochs + 1))
    if np == 2:
        assert history[-1]["val_accuracy"] >= 0.90
    else:
        assert history[-1]["train_loss"] < history[0]["train_loss"]
    for other in range(1, np):
        assert files_under(ranks / f"rank{other}") == [], f"rank {other} wrote files"
    if strategy == "pipeline":
        assert (ranks / "rank0" / "runs" / "latest" / "timeline.png").stat().st_size > 0
        line = re.search(r"pipeline bubble: measured ([\d.]+), theory ([\d.]+), replayed ([\d.]+) ", proc.stdout)
        assert line, proc.stdout[-3000:]
        assert float(line.group(3)) <= float(line.group(1))   # the replay's messages are free
        # and what the gap to theory is made of, with each stage's compute per micro-batch
        assert re.search(r"pipeline bubble: ([\d.]+ above theory: .*\(a micro-batch computes stage 0 [\d.]+ ms, "
                         r"stage 1 [\d.]+ ms\); |the bubble is within 10% of theory)", proc.stdout), proc.stdout[-3000:]
    else:
        assert len(set(json.loads((ranks / "digests.json").read_text()))) == 1
    assert (ranks / "rank0" / "mlflow.db").exists() == tracked
    if tracked:
        assert_one_run_with_a_model_per_epoch(ranks / "rank0" / "mlflow.db", "proj", epochs)


def assert_one_run_with_a_model_per_epoch(store: Path, experiment: str, epochs: int) -> None:
    """One run, each epoch logged once, and each epoch's checkpoint a LoggedModel of that run, then the final model."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    [run] = client.search_runs([experiment_id])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "epoch")] == list(range(1, epochs + 1))
    models = client.search_logged_models(experiment_ids=[experiment_id],
                                         order_by=[{"field_name": "creation_timestamp", "ascending": True}])
    assert [m.name for m in models] == [f"checkpoint-{e}" for e in range(1, epochs + 1)] + ["model"]
    assert {m.source_run_id for m in models} == {run.info.run_id}


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("strategy, override, message", [
    ("pipeline", [], "config error: world size 1 (horovodrun -np) is not stages 2 x replicas: "
                     "use -np 2, 4, 6... or a --stages that divides 1"),
    ("model-split", ["--parallel.partition", "nope"], "config error: stage start 'nope' is not a block: blocks are "),
    ("pipeline", ["--parallel.schedule", "interleaved-1f1b", "--parallel.micro_batches", "3"],
     "config error: parallel.micro_batches 3 is not a multiple of parallel.stages 2: interleaved-1f1b sends "
     "micro-batches round the stages in groups of 2; use 4"),
])
def test_bad_stage_setting_stops_with_one_line(tmp_path, framework, strategy, override, message):
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--strategy", strategy,
                    "--output", str(tmp_path)], check=True)
    workdir = tmp_path / "work"
    workdir.mkdir()
    proc = subprocess.run(python_command([sys.executable, str(tmp_path / "proj" / "train.py"), *override]),
                          cwd=workdir, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    # The last line is ours; TensorFlow may log its own start-up lines before it.
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-2000:]
    assert proc.stderr.count("config error") == 1
    assert list(workdir.iterdir()) == [], "nothing written"


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_pipeline_trains_alike_at_any_cut_and_resumes_at_its_own(tmp_path, framework):
    """Where the stages cut changes nothing but speed: every stage starts from the same model.
    torch's checkpoint (shards, under the model's names) resumes at another cut on the same
    losses; TensorFlow's holds each stage's blocks, so a run cut elsewhere stops with one line
    naming the checkpoint's cut and leaves its files alone. `time` resumes at the checkpoint's cut."""
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--strategy", "pipeline",
                    "--output", str(tmp_path)], check=True)
    project = tmp_path / "proj"

    def train(ranks: Path, cut: str, epochs: int, check: bool = True) -> subprocess.CompletedProcess:
        return run_horovod(2, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
                               "--train.epochs", str(epochs), "--parallel.partition", cut, "--tracking.enabled", "false"],
                           cwd=project, env={"SKIP_DIGEST": "1"} | importing(project), timeout=300, check=check)

    def last_epoch(ranks: Path) -> dict:
        return json.loads((ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()[-1])

    histories = []
    for cut in ("2", "3"):
        train(tmp_path / f"cut{cut}", cut, epochs=1)
        histories.append(last_epoch(tmp_path / f"cut{cut}"))
    for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy"):
        assert histories[0][key] == pytest.approx(histories[1][key], rel=1e-5, abs=1e-6), key

    ranks = tmp_path / "cut3"
    shutil.copytree(ranks, tmp_path / "elsewhere")
    elsewhere = train(tmp_path / "elsewhere", "2", epochs=2)
    assert "resuming from checkpoints/ckpt-" in elsewhere.stdout
    # `time` resumes where the checkpoint cut (stage 1: block 3 alone), whatever its timings would say
    resumed = train(ranks, "time", epochs=2)
    assert "resuming from checkpoints/ckpt-" in resumed.stdout and "; stage 1: " in resumed.stdout
    assert resumed.stdout.split("; stage 1: ", 1)[1].split("\n", 1)[0].endswith("(1 block, 650 parameters)")
    # epoch 2 after a resume at another cut: the same as at the checkpoint's own
    at_own, at_another = last_epoch(ranks), last_epoch(tmp_path / "elsewhere")
    assert at_own["epoch"] == at_another["epoch"] == 2
    for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy"):
        assert at_another[key] == pytest.approx(at_own[key], rel=1e-5, abs=1e-6), key
