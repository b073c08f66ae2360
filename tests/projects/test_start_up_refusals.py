"""Settings a job cannot run stop every rank at start-up: one `config error:` line, from rank 0, nothing written.

Run as a user would: a generated project, `horovodrun -np 2 --gloo python train.py` in its folder.
- `--horovod.adasum true` on Gloo (Horovod has Adasum only in its MPI controller): refused before
  the first step, where it would fail with HorovodInternalError (an endless reset when elastic).
- data that cannot be read (`--data.source npz --data.path` a file that is not there): the
  loader's own message, not a traceback from every rank.
- an .npz whose x has more rows than its y (once trained on without a word).
- a pipeline resumed from a checkpoint of another model (`--model.hidden` changed after an
  epoch): each rank holds its own stage, so each judges its own part, and all stop with the same
  line instead of one rank dying on a state_dict error while the others wait.
- an elastic job resumed from a checkpoint of another model: rank 0's reason reaches the others in
  the elastic state's first sync, and all stop before anything is written.
- the ResNet-18 and GPT projects' own data and model problems: an image folder without images,
  an image that is not one, a token file shorter than one context window, a tied GPT head split
  from its embedding, fp16 on a CPU, train.compile on where it does not compile (a torch pipeline
  stage, Keras, ZeRO 3), horovod.zero where it does not shard (2 on a pipeline, 3 in Keras), a GPT past this host's memory (whole, and as a pipeline whose
  second stage would fit: its rank stops on the same line, the host judged by both stages).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import horovodrun_path, python_command, run_horovod, venv_env

pytestmark = pytest.mark.slow
FRAMEWORKS = ["torch", "tensorflow"]
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}
SMALL_DATA = ("--data.source", "synthetic", "--data.synthetic_samples", "512")


def generate(tmp_path: Path, framework: str, strategy: str, model: str = "mlp", *flags: str) -> Path:
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--strategy", strategy,
                    "--model", model, "--output", str(tmp_path), *flags], check=True, capture_output=True)
    return tmp_path / "proj"


def files(project: Path) -> dict[str, tuple[int, int]]:
    """Every file of the project with its size and modification time (Python's own caches aside)."""
    return {str(p.relative_to(project)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def rank_stderr(stderr: str, rank: int) -> list[str]:
    """What one rank wrote to its stderr: horovodrun forwards it as `[rank]<stderr>:line`."""
    prefix = f"[{rank}]<stderr>:"
    return [line[len(prefix):] for line in stderr.splitlines() if line.startswith(prefix)]


# The elastic project's README command: 2 ranks on this machine, under two host names.
ELASTIC = ["--min-np", "1", "--max-np", "2", "--host-discovery-script", "./discover_hosts.sh",
           "--network-interface", "lo", "--gloo"]


def run_elastic(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    command = [horovodrun_path(), "-np", "2", *ELASTIC, *python_command([sys.executable, "train.py", *args])]
    proc = subprocess.run(command, cwd=project, env=venv_env(**QUIET), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 or not check, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def refused(project: Path, *args: str, elastic: bool = False) -> str:
    """Run train.py under horovodrun -np 2 (elastic: as the elastic README says); assert the job
    failed with one config-error line, from rank 0, no traceback and no other word from rank 1, and
    nothing in the project changed. Returns that line."""
    before = files(project)
    if elastic:
        proc = run_elastic(project, *args, check=False)
    else:
        proc = run_horovod(2, [sys.executable, "train.py", *args], cwd=project, env=QUIET, timeout=400, check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    said = {}
    for rank in range(2):
        # `Terminated`: horovodrun's own word when it stops a rank after another has exited first
        said[rank] = [line for line in rank_stderr(proc.stderr, rank) if line.strip() and line.strip() != "Terminated"]
        assert not any("Traceback" in line for line in said[rank]), f"rank {rank}:\n" + "\n".join(said[rank][-30:])
    assert said[0] and said[0][-1].startswith("config error: "), "rank 0:\n" + "\n".join(said[0][-30:])
    assert sum(line.startswith("config error:") for line in said[0]) == 1
    assert not any(line.startswith("config error:") for line in said[1]), "rank 1:\n" + "\n".join(said[1][-30:])
    assert files(project) == before, "a refused run wrote or changed files"
    return said[0][-1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_adasum_on_gloo_stops_every_rank_at_start_up(tmp_path, framework):
    project = generate(tmp_path, framework, "data")
    line = refused(project, "--horovod.adasum", "true")
    assert "horovod.adasum needs Horovod's MPI controller, but this job runs on Gloo" in line
    assert "--horovod.adasum false" in line and "horovodrun --mpi" in line


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework, strategy", [("torch", "data"), ("tensorflow", "pipeline")])
def test_unreadable_data_stops_every_rank_with_the_loaders_line(tmp_path, framework, strategy):
    project = generate(tmp_path, framework, strategy)
    line = refused(project, "--data.source", "npz", "--data.path", "mine.npz")
    assert line == "config error: data.path 'mine.npz' is not a file: point it at an .npz with x and y arrays"


@pytest.mark.timeout(600)
def test_an_npz_with_fewer_labels_than_samples_stops_every_rank(tmp_path):
    project = generate(tmp_path, "tensorflow", "data")
    np.savez(project / "short_labels.npz", x=np.zeros((10, 64), np.float32), y=np.zeros(7, np.int64))
    assert refused(project, "--data.source", "npz", "--data.path", "short_labels.npz") == (
        "config error: data.path 'short_labels.npz' holds 10 rows of x but 7 of y: each sample needs its label, one "
        "row of y for each row of x")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_pipeline_resumed_from_another_model_stops_every_rank(tmp_path, framework):
    project = generate(tmp_path, framework, "pipeline")
    run_horovod(2, [sys.executable, "train.py", "--train.epochs", "1", "--tracking.enabled", "false", *SMALL_DATA],
                cwd=project, env=QUIET, timeout=400)
    assert list((project / "checkpoints").iterdir()), "the first run left no checkpoint"

    # tracking on (the default) this time: a run that got past the restore would create mlflow.db
    line = refused(project, "--train.epochs", "2", "--model.hidden", "[32]", *SMALL_DATA)
    assert line.startswith("config error: the newest checkpoint holds a different model (")
    assert "--checkpoint.dir DIR" in line and "--checkpoint.resume false" in line


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_elastic_job_resumed_from_another_model_stops_every_rank(tmp_path, framework):
    """Elastic ranks broadcast nothing at start-up (a worker that joins later could not take part):
    rank 0 alone reads the checkpoint, and its reason reaches every rank in the elastic state's
    first sync, before anything is written."""
    project = generate(tmp_path, framework, "data", "mlp", "--elastic")
    run_elastic(project, "--train.epochs", "1", "--tracking.enabled", "false", *SMALL_DATA)
    assert list((project / "checkpoints").iterdir()), "the first run left no checkpoint"
    line = refused(project, "--train.epochs", "2", "--model.hidden", "[32]", *SMALL_DATA, elastic=True)
    assert line.startswith("config error: the newest checkpoint holds a different model (")


def _no_images(project: Path) -> list[str]:
    (project.parent / "images" / "cats").mkdir(parents=True)
    return ["--data.source", "image_folder", "--data.path", str(project.parent / "images")]


def _not_an_image(project: Path) -> list[str]:
    (project.parent / "images" / "cats").mkdir(parents=True)
    (project.parent / "images" / "cats" / "tabby.png").write_text("a cat, in words")
    return ["--data.source", "image_folder", "--data.path", str(project.parent / "images")]


def _tokens_of(project: Path, text: str) -> list[str]:
    """Token files made from `text` by the project's own prepare_tokens.py; the overrides that use them."""
    corpus = project.parent / "corpus.txt"
    corpus.write_text(text)
    subprocess.run([sys.executable, "prepare_tokens.py", str(corpus), "--out", str(project.parent / "tokens")],
                   cwd=project, check=True, capture_output=True)
    return ["--data.path", str(project.parent / "tokens")]


# 38.7 billion parameters: refused by the memory plan before a value is drawn, on any machine
HUGE_GPT = ["--model.layers", "48", "--model.width", "8192", "--model.heads", "64"]

WORKLOAD_REFUSALS = [
    # (framework, model, strategy, arguments made from the project, the line every rank prints)
    ("torch", "resnet18", "data", _no_images, "has class folders but no images (.png, .jpg, .jpeg, .bmp, .gif, "
                                              ".webp): use ROOT/<class>/<image files>"),
    ("torch", "resnet18", "pipeline", _not_an_image, "tabby.png is not a readable image (cannot identify image file"),
    ("torch", "gpt", "data", lambda p: _tokens_of(p, "too short for a context window"),
     "train.bin holds 27 tokens, fewer than the 128 one context window needs (model.context 64): use more text, or "
     "lower model.context"),
    ("torch", "gpt", "model-split",
     lambda p: [*_tokens_of(p, (p / "README.md").read_text()), "--model.tie_embeddings", "true"],
     "blocks 0 and 5 share a parameter (tied weights) but fall on different stages: untie them (a GPT's "
     "model.tie_embeddings: false), or keep both on one stage"),
    # its ranks reach the check seconds apart after TensorFlow's start: rank 1, when first, waits for rank 0's line
    ("tensorflow", "gpt", "model-split",
     lambda p: [*_tokens_of(p, (p / "README.md").read_text()), "--model.tie_embeddings", "true"],
     "share a parameter (tied weights) but fall on different stages: untie them (a GPT's model.tie_embeddings: "
     "false), or keep both on one stage"),
    ("torch", "resnet18", "data", lambda p: ["--train.precision", "fp16"],
     "train.precision fp16 needs a GPU (its loss scaling is CUDA's): use bf16 on the CPU, or fp32"),
    ("torch", "gpt", "tensor", lambda p: [*_tokens_of(p, (p / "README.md").read_text()), "--parallel.tp", "3"],
     "world size 2 (horovodrun -np) is not tp 3 x replicas: use -np 3, 6, 9... or a tp that divides 2"),
    ("torch", "gpt", "tensor", lambda p: [*_tokens_of(p, (p / "README.md").read_text()), "--model.heads", "1"],
     "model.heads 1 do not split over tp 2: choose a tp that divides 1"),
    ("torch", "gpt", "tensor", lambda p: [*_tokens_of(p, (p / "README.md").read_text()), "--model.dropout", "0.1"],
     "model.dropout 0.1 with tensor parallelism: the group's ranks would drop different parts of the activations "
     "they share; set model.dropout 0"),
    ("torch", "gpt", "data", lambda p: [*_tokens_of(p, (p / "README.md").read_text()), *HUGE_GPT],
     "memory: the 2 rank(s) on this host would hold about 1254.48 GiB (627.24 GiB each: 576.12 GiB of parameters, "
     "gradients and optimizer state, 51.13 GiB of activations), more than the "),
    # stage 1 holds the head alone and fits: it stops on stage 0's line, the host judged by both stages
    ("torch", "gpt", "pipeline",
     lambda p: [*_tokens_of(p, (p / "README.md").read_text()), *HUGE_GPT, "--parallel.partition", "49"],
     "memory: the 2 rank(s) on this host would hold about 601.68 GiB (601.62 GiB on the fullest: 576.12 GiB of "
     "parameters, gradients and optimizer state, 25.50 GiB of activations), more than the "),
    ("tensorflow", "gpt", "data", lambda p: [*_tokens_of(p, (p / "README.md").read_text()), *HUGE_GPT],
     "memory: the 2 rank(s) on this host would hold about 1152.23 GiB (576.12 GiB each: 576.12 GiB of parameters, "
     "gradients and optimizer state, activations not counted), more than the "),
    ("tensorflow", "resnet18", "pipeline", _not_an_image,
     "tabby.png is not a readable image (cannot identify image file"),
    ("tensorflow", "resnet18", "data", lambda p: ["--train.precision", "fp16"],
     "train.precision fp16 needs a GPU (its loss scaling exists for GPU half precision): use bf16 on the CPU, "
     "or fp32"),
    ("torch", "mlp", "pipeline", lambda p: ["--train.compile", "on"],
     "train.compile on is for the data, model-split and tensor strategies: a pipeline stage runs eager; set "
     "train.compile auto or off"),
    ("tensorflow", "mlp", "data", lambda p: ["--train.compile", "on"],
     "train.compile on compiles torch models (torch.compile): a Keras project's step runs as a traced "
     "tf.function; set train.compile auto or off"),
    ("torch", "mlp", "pipeline", lambda p: ["--horovod.zero", "2"],
     "horovod.zero 2 does not work with pipeline stages (every micro-batch's backward would reduce-scatter "
     "again): use horovod.zero 1"),
    ("torch", "mlp", "data", lambda p: ["--horovod.zero", "3", "--train.compile", "on"],
     "train.compile on does not work with horovod.zero 3 (its blocks gather their parameters as they run): set "
     "train.compile auto or off, or horovod.zero 2"),
    ("tensorflow", "mlp", "data", lambda p: ["--horovod.zero", "3"],
     "horovod.zero 3 does not work with a Keras project (its layers hold whole variables): use horovod.zero 1 or "
     "2, or a torch project"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework, model, strategy, make_args, problem", WORKLOAD_REFUSALS,
                         ids=["no-images", "not-an-image", "short-tokens", "tied-head-split", "tf-tied-head-split", "fp16-on-cpu",
                              "tp-not-dividing-np", "tp-not-dividing-heads", "tp-with-dropout",
                              "model-past-memory", "stage-past-memory", "tf-model-past-memory", "tf-not-an-image",
                              "tf-fp16-on-cpu", "compile-on-a-pipeline", "tf-compile-on", "zero-on-a-pipeline",
                              "compile-on-zero3", "tf-zero"])
def test_workload_data_and_model_problems_stop_every_rank(tmp_path, framework, model, strategy, make_args, problem):
    project = generate(tmp_path, framework, strategy, model)
    line = refused(project, *make_args(project))
    assert problem in line, line
    if problem.startswith("memory:"):   # the settings that hold less, activations first where they are counted
        fixes = ("model.recompute blocks (activations), " if framework == "torch" else "") + (
            "more parallel.stages, or a larger parallel.tp for a GPT" if strategy == "pipeline" else
            ("horovod.zero 3 (each replica holds 1/replicas of the model), " if framework == "torch" else "") +
            "a project that splits the model (hvdgen new --strategy pipeline or tensor)")
        assert line.endswith(f" of this host: use fewer ranks on this host, a smaller model, or {fixes}"), line
