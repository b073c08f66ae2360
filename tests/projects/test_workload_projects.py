"""Generated ResNet-18 and GPT projects train from data on disk, under every strategy, and resume exactly.

For each strategy, a project generated with `--model resnet18` trains on an image folder the
test writes (read by DataLoader worker processes), and one generated with `--model gpt` on token
files made by the project's own prepare_tokens.py from a text file. Each trains two short epochs
under `horovodrun -np 2`: the loss falls, every rank ends with the same weights, and a second
run resumed from a checkpoint of the first (mid-epoch for data and model-split, after epoch 1 for
the pipeline, which checkpoints per epoch) ends on the same metrics and weights. bf16 trains too.
Models are narrow and data small: the checks are about the machinery, not about accuracy.
The image folder's 58 training images leave each epoch of the pipeline a last batch of 2 images,
fewer than its 4 micro-batches: that batch runs as 2 micro-batches on every stage.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import run_horovod
from test_pipeline_resume import assert_same

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow

SIZES = {
    "resnet18": ["--model.width", "4", "--data.image_size", "16", "--data.workers", "1", "--train.batch_size", "8",
                 "--optim.lr", "0.01"],
    "gpt": ["--model.width", "16", "--model.heads", "2", "--model.layers", "2", "--model.context", "16",
            "--train.batch_size", "8", "--parallel.micro_batches", "2"],
}


def write_images(root: Path) -> None:
    """Three classes, each its own colour under noise: learnable in a few steps."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(24):
            pixels = rng.integers(0, 90, size=(12, 12, 3))
            pixels[..., c] += 150
            Image.fromarray(pixels.astype(np.uint8)).save(root / f"class{c}" / f"{i}.png")


def prepare(project: Path, model: str, tmp_path: Path) -> list[str]:
    """Write the data; return the overrides that point the project at it."""
    if model == "resnet18":
        write_images(tmp_path / "images")
        return ["--data.source", "image_folder", "--data.path", str(tmp_path / "images")]
    text = tmp_path / "corpus.txt"
    text.write_text((project / "README.md").read_text() + (project / "train.py").read_text())
    subprocess.run([sys.executable, "prepare_tokens.py", str(text), "--out", str(tmp_path / "tokens")],
                   cwd=project, check=True, capture_output=True)
    return ["--data.path", str(tmp_path / "tokens")]


def train(project: Path, ranks: Path, epochs: int, *overrides: str, digest: bool = True) -> tuple[list[dict], str]:
    env = {"DIGEST": "parameters"} if digest else {"SKIP_DIGEST": "1"}   # pipeline ranks hold different stages
    proc = run_horovod(2, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
                           "--train.epochs", str(epochs), "--tracking.enabled", "false", *overrides],
                       cwd=project, env=env, timeout=400)
    lines = (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], proc.stdout


CASES = [(model, strategy) for model in ("resnet18", "gpt") for strategy in ("data", "model-split", "pipeline")]


@pytest.mark.parametrize("model,strategy", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_generated_workload_learns_from_disk_and_resumes_exactly(tmp_path, model, strategy):
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--model", model, "--strategy", strategy,
                    "--output", str(tmp_path)], check=True, capture_output=True)
    project = tmp_path / "proj"
    args = [*prepare(project, model, tmp_path), *SIZES[model]]
    if strategy == "data":
        args = _without(args, "--parallel.micro_batches")
    metric = "val_perplexity" if model == "gpt" else "val_accuracy"

    if strategy == "pipeline":
        straight, out = train(project, tmp_path / "straight", 2, *args, digest=False)
        train(project, tmp_path / "resumed", 1, *args, digest=False)
        resumed, out = train(project, tmp_path / "resumed", 2, *args, digest=False)
        assert "from epoch 1" in out
        assert_same(resumed[-1], straight[-1], ("train_loss", "val_loss", metric))
    else:
        every = ("--checkpoint.every_steps", "2", "--checkpoint.keep", "100")
        straight, _ = train(project, tmp_path / "straight", 2, *args, *every)
        assert straight[0]["step"] > 2, "the checkpoint at step 2 must be mid-epoch"
        name = f"ckpt-{2:09d}.pt"
        (tmp_path / "resumed" / "rank0" / "checkpoints").mkdir(parents=True)
        shutil.copy(tmp_path / "straight" / "rank0" / "checkpoints" / name,
                    tmp_path / "resumed" / "rank0" / "checkpoints" / name)
        resumed, out = train(project, tmp_path / "resumed", 2, *args, *every)
        assert f"resuming from checkpoints/{name}: epoch 0, step 2" in out
        assert_same(resumed[0], straight[0], ("val_loss", metric))
        assert_same(resumed[1], straight[1], ("train_loss", "train_accuracy", "val_loss", metric))
        digests = [json.loads((tmp_path / run / "digests.json").read_text()) for run in ("straight", "resumed")]
        assert len(set(digests[0])) == 1, "the ranks' weights differ"
        assert digests[0] == digests[1], "the resumed run's final weights differ"
    assert straight[1]["train_loss"] < straight[0]["train_loss"]
    assert straight[1]["train_samples_per_s"] > 0 and straight[1]["train_step_time_ms"] > 0
    assert ("train_tokens_per_s" in straight[1]) == (model == "gpt")


BF16_CASES = [("resnet18", "data"), ("gpt", "pipeline")]


@pytest.mark.parametrize("model,strategy", BF16_CASES, ids=[f"{m}-{s}" for m, s in BF16_CASES])
def test_generated_workload_trains_in_bf16_on_the_cpu(tmp_path, model, strategy):
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--model", model, "--strategy", strategy,
                    "--output", str(tmp_path)], check=True, capture_output=True)
    project = tmp_path / "proj"
    args = [*prepare(project, model, tmp_path), *SIZES[model], "--train.precision", "bf16"]
    if strategy == "data":
        args = _without(args, "--parallel.micro_batches")
    epochs, _ = train(project, tmp_path / "run", 2, *args, digest=strategy != "pipeline")
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert all(np.isfinite(e["val_loss"]) for e in epochs)


def _without(args: list[str], flag: str) -> list[str]:
    """args less `flag` and its value."""
    if flag not in args:
        return args
    i = args.index(flag)
    return args[:i] + args[i + 2:]
