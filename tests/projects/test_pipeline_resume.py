"""Generated staged projects (pipeline and model-split) resume exactly where an uninterrupted run went.

pipeline: stopped after an epoch and started again. Rank 0 gathers every stage into one
checkpoint; on restart each rank takes its own stage, its optimizer state and its RNG state
back, so epoch 2 of the resumed run repeats epoch 2 of the uninterrupted one.

model-split: resumed mid-epoch. The uninterrupted run checkpoints every few steps; a second run
starts from a copy of one mid-epoch checkpoint of epoch 1 alone, which is what a job stopped at
that step leaves behind (rank 0 is the only writer), and must end on the same losses, metrics,
step and final weights. It resumes at another cut (stage 1 from block 3, not the parameter
balance's 2): a model-split checkpoint holds the model under its own names, so any cut reads it;
the MLP's numbers do not depend on the cut. (A GPT's may, by rounding: `time` resumes where the
checkpoint was cut, test_workload_projects.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import copy_checkpoint, importing, run_horovod

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow


def generate(tmp_path: Path, framework: str, strategy: str) -> Path:
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--strategy", strategy,
                    "--output", str(tmp_path)], check=True)
    return tmp_path / "proj"


def train(project: Path, ranks: Path, epochs: int, *overrides: str, env: dict | None = None,
          np_: int = 2) -> tuple[list[dict], str]:
    """Untracked: MLflow never changes what is trained, and tracked pipelines are
    test_tracking_project's (torch) and test_staged_projects' (TensorFlow)."""
    proc = run_horovod(np_, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
                           "--train.epochs", str(epochs), "--tracking.enabled", "false", *overrides],
                       cwd=project, env=(env or {}) | importing(project), timeout=400)
    lines = (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], proc.stdout


def assert_same(got: dict, expected: dict, keys: tuple[str, ...]) -> None:
    assert got["epoch"] == expected["epoch"] and got["step"] == expected["step"]
    for key in keys:
        assert got[key] == pytest.approx(expected[key], rel=1e-5), (got["epoch"], key)


# 1f1b's ranks (each framework) start as users start them: a cold interpreter each (plain_start)
@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.plain_start), "interleaved-1f1b"])
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_pipeline_resumes_exactly(tmp_path, framework, schedule):
    """Also interleaved: each rank's checkpoint part holds both its chunks, under the model's names."""
    project = generate(tmp_path, framework, "pipeline")
    skip_digest = {"SKIP_DIGEST": "1"}      # pipeline ranks hold different stages
    choice = ["--parallel.schedule", schedule]
    straight, _ = train(project, tmp_path / "straight", 2, *choice, env=skip_digest)
    train(project, tmp_path / "resumed", 1, *choice, env=skip_digest)
    resumed, out = train(project, tmp_path / "resumed", 2, *choice, env=skip_digest)
    assert "resuming from checkpoints/ckpt-" in out and "from epoch 1" in out
    assert f"{schedule}, 4 micro-batches" in out
    if schedule == "interleaved-1f1b":   # its stages hold other blocks than one chunk a stage would
        other = run_horovod(2, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project),
                                str(tmp_path / "resumed"), "--train.epochs", "3"], cwd=project, env=skip_digest | importing(project),
                            timeout=400, check=False)
        # shards: each rank reads its blocks, wherever they were (both frameworks)
        assert other.returncode == 0 and "resuming from checkpoints/ckpt-" in other.stdout, other.stderr[-3000:]
        assert "epoch   3" in other.stdout
    assert resumed[-1]["epoch"] == 2
    assert_same(resumed[-1], straight[-1], ("train_loss", "val_loss", "val_accuracy"))


def test_a_zero_pipeline_resumes_exactly_and_without_replicas(tmp_path):
    """horovod.zero 1 on 2 stages x 2 replicas: each rank writes its rows of its stage's optimizer
    state, and reads them back; the resumed epoch 2 equals the straight run's. The same checkpoint
    resumes on 2 ranks (no replicas, no ZeRO), each reading its stage's whole state from both
    replicas' rows."""
    project = generate(tmp_path, "torch", "pipeline")
    skip_digest = {"SKIP_DIGEST": "1"}      # pipeline ranks hold different stages
    zero = ["--horovod.zero", "1"]          # the MLP's SGD keeps momentum: a state to shard
    straight, out = train(project, tmp_path / "straight", 2, *zero, env=skip_digest, np_=4)
    assert "pipeline of 2 stages x 2 replica(s)" in out and "under ZeRO 1 over 2 replicas" in out
    [saved] = (tmp_path / "straight" / "rank0" / "checkpoints").glob(f"ckpt-{straight[0]['step']:09d}")
    assert len(list(saved.glob("rank-*.safetensors"))) == 4   # every replica wrote its rows
    resumed = {}
    for ranks, np_ in (("resumed", 4), ("unreplicated", 2)):
        copy_checkpoint(saved, tmp_path / ranks / "rank0" / "checkpoints")
        resumed[np_], out = train(project, tmp_path / ranks, 2, *(zero if np_ == 4 else []), env=skip_digest, np_=np_)
        assert "resuming from checkpoints/ckpt-" in out and "from epoch 1" in out, out[-3000:]
        assert [r["epoch"] for r in resumed[np_]] == [2]
    assert_same(resumed[4][-1], straight[-1], ("train_loss", "val_loss", "val_accuracy"))


@pytest.mark.plain_start   # model-split's ranks start as users start them, a cold interpreter each
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_model_split_resumes_exactly_mid_epoch(tmp_path, framework):
    project = generate(tmp_path, framework, "model-split")
    every = ("--checkpoint.every_steps", "10", "--checkpoint.keep", "100")
    straight, _ = train(project, tmp_path / "straight", 2, *every)
    steps_per_epoch = straight[0]["step"]
    assert steps_per_epoch > 10, "the checkpoint at step 10 must be mid-epoch"
    name = f"ckpt-{10:09d}"
    copy_checkpoint(tmp_path / "straight" / "rank0" / "checkpoints" / name,
                    tmp_path / "resumed" / "rank0" / "checkpoints")

    resumed, out = train(project, tmp_path / "resumed", 2, *every, "--parallel.partition", "3")
    assert f"resuming from checkpoints/{name}: epoch 0, step 10" in out
    # epoch 1 trained only its last steps after the resume: its train totals are partial, the rest must match
    assert_same(resumed[0], straight[0], ("val_loss", "val_accuracy"))
    assert_same(resumed[1], straight[1], ("train_loss", "train_accuracy", "val_loss", "val_accuracy"))
    digests = [json.loads((tmp_path / run / "digests.json").read_text()) for run in ("straight", "resumed")]
    assert digests[0] == digests[1], "the final weights differ"
