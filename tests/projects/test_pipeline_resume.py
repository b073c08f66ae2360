"""A generated pipeline project stopped after an epoch and started again ends where an uninterrupted run ends.

Rank 0 gathers every stage into one checkpoint; on restart each rank takes its own stage, its
optimizer state and its RNG state back, so epoch 2 of the resumed run repeats epoch 2 of the
uninterrupted one.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_horovod

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow


def train(project: Path, ranks: Path, epochs: int) -> tuple[list[dict], str]:
    proc = run_horovod(2, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
                           "--train.epochs", str(epochs)], cwd=project, env={"SKIP_DIGEST": "1"}, timeout=400)
    lines = (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], proc.stdout


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_pipeline_resumes_exactly(tmp_path, framework):
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--strategy", "pipeline",
                    "--output", str(tmp_path)], check=True)
    project = tmp_path / "proj"
    straight, _ = train(project, tmp_path / "straight", 2)
    train(project, tmp_path / "resumed", 1)
    resumed, out = train(project, tmp_path / "resumed", 2)
    assert "resuming from checkpoints/ckpt-" in out and "from epoch 1" in out
    last = resumed[-1]
    assert last["epoch"] == 2 and last["step"] == straight[-1]["step"]
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert last[key] == pytest.approx(straight[-1][key], rel=1e-5), key
