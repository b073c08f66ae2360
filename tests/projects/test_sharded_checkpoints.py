"""Checkpoints as folders of shards, tried as a user would: generated projects under horovodrun.

Both frameworks, each case:
- Resume at any layout: a GPT pipeline of 2 stages x tp 2 (4 ranks) trains three epochs; its
  epoch-1 checkpoint resumes unsplit (1 rank), at tp 2 and at pp 2, and the checkpoint each of
  those writes after epoch 2 resumes back at pp 2 x tp 2. Every resumed epoch equals the straight
  run's within 1e-5: each rank read exactly its rows of every tensor, whoever wrote them. The
  unsplit and pp 2 epochs recompute their blocks' activations in backward (model.recompute:
  blocks), the others keep them: the same numbers.
- The whole model rank 0 writes from the shards at the end of a run (runs/latest/model.safetensors)
  is the whole model's (torch: its state_dict; Keras: its variables by name), and the same
  (1e-5) whether 1, 2 or 4 ranks' shards made it: the straight run's and each run resumed back;
  the runs at unsplit, tp 2 and pp 2 alike.
- A job SIGKILLed in the middle of writing its shards (rank 1's written, rank 0's index not yet)
  resumes from the previous checkpoint, on the straight run's losses; the half-written folder is
  never taken for a checkpoint.
- A damaged newest checkpoint, when it is the only one: a missing shard, a truncated shard, an
  index naming a tensor the model lacks. Every rank stops on the same config-error line naming
  the problem and the fix, and nothing in the project changes. (A model whose shapes changed:
  test_start_up_refusals' pipeline case; a damaged newest with an older one to fall back to:
  test_fault_tolerance.)

Cost: about a tenth of the suite's CPU (docs/testing.md), since it runs the resume matrix for both
frameworks: one straight run at pp 2 x tp 2, then three resumes and three returns, each a
horovodrun job of 1 to 4 ranks, plus the kill-mid-write and damaged-shard jobs. The matrix needs
a real job at each layout; the MLP cases share one straight run per framework.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import copy_checkpoint, horovodrun_path, importing, python_command, run_horovod, venv_env
from test_start_up_refusals import QUIET, SMALL_DATA, refused
from test_start_up_refusals import generate as generate_mlp
from test_tensor_projects import generate, train

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# -np, parallel.stages, parallel.tp
LAYOUTS = {"pp2xtp2": (4, 2, 2), "unsplit": (1, 1, 1), "tp2": (2, 1, 2), "pp2": (2, 2, 1)}
KEYS = ("train_loss", "train_accuracy", "val_loss", "val_perplexity")


def at(layout: str) -> tuple[int, tuple[str, ...]]:
    np_, stages, tp = LAYOUTS[layout]
    return np_, ("--parallel.stages", str(stages), "--parallel.tp", str(tp))


def assert_same(got: dict, expected: dict, what: str) -> None:
    assert (got["epoch"], got["step"]) == (expected["epoch"], expected["step"]), what
    for key in KEYS:
        assert got[key] == pytest.approx(expected[key], rel=1e-5), (what, key)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_checkpoint_resumes_at_every_layout_and_back(tmp_path, framework):
    project, args = generate(tmp_path, framework, "--strategy", "pipeline", "--stages", "2", "--tp", "2")
    np_, layout = at("pp2xtp2")
    straight, out, _ = train(np_, project, tmp_path / "straight", 3, *args, *layout, digest=False)
    assert "pipeline of 2 stages (tp 2) x 1 replica(s)" in out
    assert straight[2]["train_loss"] < straight[0]["train_loss"]
    first = straight[0]["step"]
    assert not list((tmp_path / "straight").glob("rank[123]/checkpoints/*")), "a checkpoint outside rank 0's folder"
    [saved] = (tmp_path / "straight" / "rank0" / "checkpoints").glob(f"ckpt-{first:09d}")
    assert {p.name for p in saved.iterdir()} == {"index.json", *(f"rank-0000{r}.safetensors" for r in range(4))}
    # the index names the whole model's tensors, with their whole shapes, never a slice's
    shapes = {name.removeprefix("model/"): tuple(t["shape"])
              for name, t in json.loads((saved / "index.json").read_text())["tensors"].items()}
    assert {name: shapes.get(name) for name in WHOLE[framework]} == WHOLE[framework]
    assert_whole_models_equal([whole_model(tmp_path / "straight")], framework)
    epoch_2 = {}
    for name in ("unsplit", "tp2", "pp2"):
        ranks = tmp_path / name
        copy_checkpoint(saved, ranks / "rank0" / "checkpoints")
        np_, layout = at(name)
        # recomputed blocks at two of the layouts (the whole model's path and a pipeline's): the same numbers
        recompute = ("--model.recompute", "blocks") if name != "tp2" else ()
        there, out, _ = train(np_, project, ranks, 2, *args, *layout, *recompute, digest=False)
        assert f"resuming from checkpoints/{saved.name}: epoch 1, step {first}" in out
        assert len(there) == 1
        assert_same(there[0], straight[1], f"pp2xtp2 resumed at {name}")
        epoch_2[name] = whole_model(ranks)

        np_, layout = at("pp2xtp2")
        back, out, _ = train(np_, project, ranks, 3, *args, *layout, digest=False)
        assert f"resuming from checkpoints/ckpt-{straight[1]['step']:09d}: epoch 2" in out
        assert_same(back[-1], straight[2], f"{name} resumed at pp2xtp2")
        assert_whole_models_equal([whole_model(tmp_path / "straight"), whole_model(ranks)], framework)
    # the model file rank 0 writes from 1, 2 (tp) and 2 (stages) shards: one whole model
    assert_whole_models_equal(list(epoch_2.values()), framework)


def whole_model(ranks: Path) -> dict:
    """The model.safetensors rank 0 wrote at the end of the run (no other rank writes one), as arrays."""
    from safetensors.numpy import load_file

    assert not list(ranks.glob("rank[123]/runs/latest/model.safetensors")), "a rank other than 0 wrote the model"
    return load_file(str(ranks / "rank0" / "runs" / "latest" / "model.safetensors"))


# Names and shapes of the unsplit GPT (width 16, 2 layers, vocabulary 256) in each framework's file.
WHOLE = {"torch": {"0.tokens.weight": (256, 16), "1.qkv.weight": (48, 16), "1.mlp.2.weight": (16, 64),
                   "3.out.weight": (256, 16)},
         "tensorflow": {"0.tokens.embeddings": (256, 16), "1.qkv.kernel": (16, 48), "1.out.kernel": (64, 16),
                        "3.out.kernel": (16, 256)}}


def assert_whole_models_equal(models: list[dict], framework: str) -> None:
    """The unsplit GPT's weights, whole tensors under their names in the whole model, equal at 1e-5.

    But for the keys' bias (the middle third of each qkv bias): a constant added to every key's
    score leaves the softmax unchanged, so its exact gradient is zero and what training leaves in
    it is rounding noise (about 1e-6 after three epochs, Adam rescaling the noise, a different
    sum order at each layout). It must stay that: within 1e-5 of the other run's, absolutely.
    """
    import numpy as np

    first = models[0]
    assert {name: tuple(first[name].shape) for name in WHOLE[framework] if name in first} == WHOLE[framework]
    for other in models[1:]:
        assert set(other) == set(first)
        for key, t in first.items():
            if key.endswith("qkv.bias"):
                (q, k, v), (q2, k2, v2) = np.split(t, 3), np.split(other[key], 3)
                np.testing.assert_allclose(k2, k, rtol=0, atol=1e-5, err_msg=f"{key}, the keys' third")
                t, got = np.concatenate([q, v]), np.concatenate([q2, v2])
            else:
                got = other[key]
            np.testing.assert_allclose(got, t, rtol=1e-5, atol=1e-6, err_msg=key)


STOP_MID_WRITE = """\
\"\"\"train.py, except that rank 1 stops itself (SIGSTOP) once it has written its shard of checkpoint
STEP, before rank 0 writes the index; it touches MARKER first. FRAMEWORK: torch or tf.
usage: PYTHONPATH=<project> python stop.py FRAMEWORK STEP MARKER ARGS...\"\"\"
import importlib, os, runpy, signal, sys
from pathlib import Path

framework, step, marker = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
sys.argv = ["train.py", *sys.argv[4:]]
if os.environ["HOROVOD_RANK"] == "1":
    checkpoint = importlib.import_module(f"hvd_runtime.{framework}.checkpoint")

    write_shard = checkpoint._write_shard

    def stopping(folder, *args, **kwargs):
        described = write_shard(folder, *args, **kwargs)
        if folder.name == f".ckpt-{step:09d}.partial":
            marker.touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        return described

    checkpoint._write_shard = stopping
runpy.run_path("train.py", run_name="__main__")
"""


MLP_PIPELINE = ["--train.epochs", "3", "--tracking.enabled", "false", *SMALL_DATA]


def epochs_of(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, a dict per epoch."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@dataclass
class Straight:
    """An MLP pipeline project of 2 stages and its uninterrupted run of MLP_PIPELINE's 3 epochs."""

    project: Path
    metrics: list[dict]
    checkpoints: Path      # one checkpoint per epoch, all three kept


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory) -> Callable[[str], Straight]:
    """Per framework, made on first use: the killed-mid-write test compares with its metrics, the
    damaged-checkpoint test damages a copy of its first checkpoint (one job for both)."""
    made: dict[str, Straight] = {}

    def straight(framework: str) -> Straight:
        if framework not in made:
            root = tmp_path_factory.mktemp(f"straight-{framework}")
            project = generate_mlp(root, framework, "pipeline")
            run_horovod(2, [sys.executable, "train.py", *MLP_PIPELINE, "--run_dir", str(root / "run"),
                            "--checkpoint.dir", str(root / "ckpt")], cwd=project, env=QUIET, timeout=400)
            made[framework] = Straight(project, epochs_of(root / "run"), root / "ckpt")
        return made[framework]

    return straight


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_job_killed_while_writing_its_shards_resumes_from_the_previous_checkpoint(tmp_path, framework,
                                                                                    straight_runs):
    made = straight_runs(framework)
    project, straight = made.project, made.metrics
    per_epoch = straight[0]["step"]

    ckpt, marker = tmp_path / "ckpt", tmp_path / "stopped"
    (tmp_path / "stop.py").write_text(STOP_MID_WRITE)
    args = [*MLP_PIPELINE, "--run_dir", str(tmp_path / "killed"), "--checkpoint.dir", str(ckpt)]
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        job = subprocess.Popen([horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo",
                                *python_command([sys.executable, str(tmp_path / "stop.py"),
                                                 "torch" if framework == "torch" else "tf", str(2 * per_epoch),
                                                 str(marker), *args])],
                               cwd=project, env=venv_env(**QUIET, **importing(project)), stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGKILL)   # the whole job: horovodrun and both ranks
    finally:
        job.wait(timeout=60)
    partial = ckpt / f".ckpt-{2 * per_epoch:09d}.partial"
    assert (partial / "rank-00001.safetensors").is_file() and not (partial / "index.json").exists()
    assert [p.name for p in ckpt.iterdir() if not p.name.startswith(".")] == [f"ckpt-{per_epoch:09d}"]

    resumed = run_horovod(2, [sys.executable, "train.py", *MLP_PIPELINE, "--run_dir", str(tmp_path / "resumed"),
                              "--checkpoint.dir", str(ckpt)], cwd=project, env=QUIET, timeout=400)
    assert f"resuming from {ckpt / f'ckpt-{per_epoch:09d}'}: epoch 1, step {per_epoch}" in resumed.stdout
    got = epochs_of(tmp_path / "resumed")
    assert [m["epoch"] for m in got] == [2, 3]
    for mine, expected in zip(got, straight[1:]):
        assert mine["step"] == expected["step"]
        for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy"):
            assert mine[key] == pytest.approx(expected[key], rel=1e-5), (mine["epoch"], key)
    assert not partial.exists(), "the next checkpoint did not clear the half-written folder"


def _drop_a_shard(folder: Path) -> str:
    (folder / "rank-00001.safetensors").unlink()
    return "rank-00001.safetensors is missing"


def _truncate_a_shard(folder: Path) -> str:
    shard = folder / "rank-00000.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    return f"rank-00000.safetensors is {size // 2} bytes, the index says {size} (truncated?)"


def _name_a_tensor_the_model_lacks(folder: Path) -> str:
    index = json.loads((folder / "index.json").read_text())
    some = next(iter(index["tensors"].values()))
    index["tensors"]["model/extra.weight"] = {**some, "shape": [3]}
    (folder / "index.json").write_text(json.dumps(index))
    return "the newest checkpoint holds a different model (extra.weight: (3,) saved, None now)"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_damaged_only_checkpoint_stops_every_rank_with_one_line(tmp_path, framework, straight_runs):
    made = straight_runs(framework)
    project = tmp_path / "proj"
    shutil.copytree(made.project, project)
    first = min(p for p in made.checkpoints.iterdir() if not p.name.startswith("."))
    saved = copy_checkpoint(first, project / "checkpoints")   # the project's only checkpoint, as after epoch 1
    kept = copy_checkpoint(saved, tmp_path / "kept")
    for damage in (_drop_a_shard, _truncate_a_shard, _name_a_tensor_the_model_lacks):
        problem = damage(saved)
        line = refused(project, "--train.epochs", "2", *SMALL_DATA)
        assert problem in line, line
        assert "--checkpoint.resume false" in line, line
        subprocess.run(["rm", "-r", str(saved)], check=True)
        copy_checkpoint(kept, project / "checkpoints")
