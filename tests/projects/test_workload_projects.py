"""Generated ResNet-18 and GPT PyTorch projects train from data on disk, under every strategy, and resume exactly.

(test_workload_projects_tf.py runs the same checks on TensorFlow projects.) For each strategy, a project generated with `--model resnet18` trains on an image
folder the test writes (read by DataLoader worker processes, or tf.data's threads), and one
generated with `--model gpt` on token files made by the project's own prepare_tokens.py from a
text file. Each trains two short epochs under `horovodrun -np 2`: the loss falls, every rank ends
with the same weights, and a second run resumed from a checkpoint of the first (mid-epoch for
data and model-split, after epoch 1 for the pipeline, which checkpoints per epoch) ends on the
same metrics and weights (a torch ZeRO run: the same run killed mid-epoch, rank 1 SIGKILLed, and
started again in its folders). bf16 trains too.
Models are narrow and data small: the checks are about the machinery, not about accuracy.
The image folder's 58 training images leave each epoch of the pipeline a last batch of 2 images,
fewer than its 4 micro-batches: that batch runs as 2 micro-batches on every stage.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import copy_checkpoint, importing, run_horovod
from test_pipeline_resume import assert_same

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow

# ResNet-18's learning rate: at 0.01 (0.02 once warm on 2 ranks) the Keras pipeline's train loss
# rose from epoch 1 to 2 on one machine's CPU (0.98 -> 1.08, deterministic there), BatchNorm over
# micro-batches of 2 images making the step noisy; at 0.005 every case falls on it.
SIZES = {
    "resnet18": ["--model.width", "4", "--data.image_size", "16", "--train.batch_size", "8", "--optim.lr", "0.005"],
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
    # about 20 steps an epoch at 2 replicas (context 16, batch 8): enough to learn, few enough to be quick
    text.write_text((project / "README.md").read_text()[:6000])
    subprocess.run([sys.executable, "prepare_tokens.py", str(text), "--out", str(tmp_path / "tokens")],
                   cwd=project, check=True, capture_output=True)
    return ["--data.path", str(tmp_path / "tokens")]


def train(project: Path, ranks: Path, epochs: int, *overrides: str, digest: bool = True) -> tuple[list[dict], str]:
    env = {"DIGEST": "parameters"} if digest else {"SKIP_DIGEST": "1"}   # pipeline ranks hold different stages
    proc = run_horovod(2, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
                           "--train.epochs", str(epochs), "--tracking.enabled", "false", *overrides],
                       cwd=project, env=env | importing(project), timeout=400)
    lines = (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], proc.stdout


def generate(tmp_path: Path, framework: str, model: str, strategy: str, *extra: str) -> tuple[Path, list[str]]:
    """The project, and the overrides that point it at data written for it and keep it tiny."""
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--model", model,
                    "--strategy", strategy, "--output", str(tmp_path)], check=True, capture_output=True)
    project = tmp_path / "proj"
    args = [*prepare(project, model, tmp_path), *SIZES[model], *extra]
    if strategy == "data":
        args = _without(args, "--parallel.micro_batches")
    if framework == "torch" and model == "resnet18":
        args += ["--data.workers", "1"]
    return project, args


CASES = [(model, strategy) for model in ("resnet18", "gpt") for strategy in ("data", "model-split", "pipeline")]
BF16_CASES = [("resnet18", "data"), ("gpt", "pipeline")]


@pytest.mark.parametrize("model,strategy", CASES, ids=["-".join(c) for c in CASES])
def test_generated_workload_learns_from_disk_and_resumes_exactly(tmp_path, model, strategy):
    learns_from_disk_and_resumes_exactly(tmp_path, "torch", model, strategy)


@pytest.mark.parametrize("model,strategy", BF16_CASES, ids=["-".join(c) for c in BF16_CASES])
def test_generated_workload_trains_in_bf16_on_the_cpu(tmp_path, model, strategy):
    trains_in_bf16(tmp_path, "torch", model, strategy)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_zero_gpt_resumes_exactly_mid_epoch(tmp_path, zero):
    """horovod.zero: a run killed mid-epoch (rank 1 SIGKILLed) and started again resumes from its
    newest checkpoint, each rank reading its own rows, and ends on the uninterrupted run's metrics
    and weights (each rank's digest: under ZeRO 3 of its own rows). The killed rank's DataLoader
    workers end with it, so horovodrun ends the job (hvd_runtime.torch.batches.end_with_rank: before
    it, the job hung with them holding the rank's output)."""
    learns_from_disk_and_resumes_exactly(tmp_path, "torch", "gpt", "data", "--horovod.zero", str(zero))


def learns_from_disk_and_resumes_exactly(tmp_path: Path, framework: str, model: str, strategy: str,
                                         *extra: str) -> None:
    project, args = generate(tmp_path, framework, model, strategy, *extra)
    metric = "val_perplexity" if model == "gpt" else "val_accuracy"
    pipeline = strategy == "pipeline"
    # The pipeline checkpoints once per epoch: resume from the end of epoch 1. The others also
    # checkpoint every 2 steps: resume mid-epoch.
    every = () if pipeline else ("--checkpoint.every_steps", "2", "--checkpoint.keep", "100")

    straight, first = train(project, tmp_path / "straight", 2, *args, *every, digest=not pipeline)
    if framework == "torch" and "--horovod.zero" in extra:
        # A ZeRO run killed mid-epoch (rank 1 SIGKILLed as it starts batch 5, after the checkpoint of
        # step 4) and started again in its folders: its newest checkpoint is step 4's.
        step = 4
        killed = run_horovod(2, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project),
                                 str(tmp_path / "resumed"), "--train.epochs", "2", "--tracking.enabled", "false",
                                 *args, *every], cwd=project, env={"KILL_AT_STEP": "5"} | importing(project),
                             timeout=400, check=False)
        assert killed.returncode != 0, killed.stdout[-2000:]
        saved = max((tmp_path / "resumed" / "rank0" / "checkpoints").glob("ckpt-*"))
        assert saved.name == f"ckpt-{step:09d}" and straight[0]["step"] > step, (saved, straight[0])
    else:
        step = straight[0]["step"] if pipeline else 2
        assert pipeline or straight[0]["step"] > 2, "the checkpoint at step 2 must be mid-epoch"
        [saved] = (tmp_path / "straight" / "rank0" / "checkpoints").glob(f"ckpt-{step:09d}*")
        copy_checkpoint(saved, tmp_path / "resumed" / "rank0" / "checkpoints")
    resumed, out = train(project, tmp_path / "resumed", 2, *args, *every, digest=not pipeline)
    assert f"resuming from checkpoints/{saved.name}: epoch {1 if pipeline else 0}, step {step}" in out
    if strategy != "data":   # `time` cuts a resumed run where its checkpoint was cut, never timing afresh
        assert cut(out) == cut(first), (cut(first), cut(out))
    if pipeline:
        assert len(resumed) == 1
        assert_same(resumed[-1], straight[-1], ("train_loss", "train_accuracy", "val_loss", metric))
    else:
        assert_same(resumed[0], straight[0], ("val_loss", metric))
        assert_same(resumed[1], straight[1], ("train_loss", "train_accuracy", "val_loss", metric))
        digests = [json.loads((tmp_path / run / "digests.json").read_text()) for run in ("straight", "resumed")]
        rows = list(extra[-2:]) == ["--horovod.zero", "3"]   # each rank holds its own rows
        assert len(set(digests[0])) == (2 if rows else 1), "the ranks' weights differ" if not rows else digests
        assert digests[0] == digests[1], "the resumed run's final weights differ"
    assert straight[1]["train_loss"] < straight[0]["train_loss"]
    assert straight[1]["train_samples_per_s"] > 0 and straight[1]["train_step_time_ms"] > 0
    assert 0 < straight[1]["train_mfu"] < 1 and f"train_mfu {straight[1]['train_mfu']:.4f}" in first
    assert ("train_tokens_per_s" in straight[1]) == (model == "gpt")


def cut(out: str) -> str:
    """Where rank 0 said the stages were cut (`parallel.partition time: stage 0: a..b (2 blocks, 36
    ms); ...`), without the costs: a cut taken from a checkpoint is described by parameters."""
    [line] = [line for line in out.splitlines() if "parallel.partition time: " in line]
    return re.sub(r"(\d+ blocks?), [^)]*\)", r"\1)", line.split("parallel.partition time: ")[1])


def trains_in_bf16(tmp_path: Path, framework: str, model: str, strategy: str) -> None:
    project, args = generate(tmp_path, framework, model, strategy, "--train.precision", "bf16")
    epochs, _ = train(project, tmp_path / "run", 2, *args, digest=strategy != "pipeline")
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert all(np.isfinite(e["val_loss"]) for e in epochs)


def _without(args: list[str], flag: str) -> list[str]:
    """args less `flag` and its value."""
    if flag not in args:
        return args
    i = args.index(flag)
    return args[:i] + args[i + 2:]
