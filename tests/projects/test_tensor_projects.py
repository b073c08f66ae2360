"""A generated `--strategy tensor` GPT project (torch and TensorFlow) trains under horovodrun and
resumes at another tp.

One job of 4 ranks (tp 2 x 2 replicas) trains two short epochs on token files the test writes:
the loss falls; the ranks holding the same slices (0 and 2, 1 and 3) end with the same weights,
and the two slices differ; the checkpoint names the whole model's tensors and shapes (each
rank of the first replica writes its slices). Then a
checkpoint written at tp 2 resumes at tp 1 (one unsplit process), and one written at tp 1
resumes at tp 2: epoch 2 of the resumed run equals the straight run's within 1e-5, so the
slices are written from, and read into, their own places. Those runs train a model.py whose
Block the test has edited: what trains at tp 2 is the block's own forward, edit included.

A pipeline of tensor-parallel stages resumed at every layout: test_sharded_checkpoints.

Cost: over 6% of the suite's CPU (docs/testing.md): 4-rank GPT jobs, and for each resume case a
straight run and a resumed one to compare at 1e-5; the tp x replicas case starts its ranks cold
(plain_start).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import copy_checkpoint, importing, run_horovod

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow

TINY = ["--model.width", "16", "--model.heads", "2", "--model.layers", "2", "--model.context", "16",
        "--train.batch_size", "8", "--tracking.enabled", "false"]


FRAMEWORKS = ["torch", "tensorflow"]


def generate(tmp_path: Path, framework: str, *shape: str) -> tuple[Path, list[str]]:
    """The project, and overrides pointing it at a small token file (about 5 steps an epoch at 2 replicas)."""
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", *(shape or ("--strategy", "tensor")), "--model",
                    "gpt", "--framework", framework, "--output", str(tmp_path)], check=True, capture_output=True)
    project = tmp_path / "proj"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((project / "README.md").read_text()[:1600])
    subprocess.run([sys.executable, "prepare_tokens.py", str(corpus), "--out", str(tmp_path / "tokens")],
                   cwd=project, check=True, capture_output=True)
    return project, ["--data.path", str(tmp_path / "tokens"), *TINY]


def train(np_: int, project: Path, ranks: Path, epochs: int, *overrides: str,
          digest: bool = True) -> tuple[list[dict], str, list[str]]:
    """Metrics of each epoch, rank 0's output, and every rank's parameter digest (none for a pipeline)."""
    env = {"DIGEST": "parameters", "TF_CPP_MIN_LOG_LEVEL": "2"} | ({} if digest else {"SKIP_DIGEST": "1"})
    proc = run_horovod(np_, [sys.executable, str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
                             "--train.epochs", str(epochs), *overrides], cwd=project, env=env | importing(project), timeout=400)
    lines = (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()
    digests = json.loads((ranks / "digests.json").read_text()) if digest else []
    return [json.loads(line) for line in lines], proc.stdout, digests


def sharded_shapes(checkpoint: Path) -> set[tuple[int, ...]]:
    """The whole shapes of the model's tensors in a folder of shards, as its index names them."""
    index = json.loads((checkpoint / "index.json").read_text())
    return {tuple(t["shape"]) for name, t in index["tensors"].items() if name.startswith("model/")}


@pytest.mark.plain_start   # tensor parallelism's ranks start as users start them, a cold interpreter each
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensor_project_trains_tp_groups_times_replicas(tmp_path, framework):
    project, args = generate(tmp_path, framework)
    epochs, out, digests = train(4, project, tmp_path / "tp2dp2", 2, *args)
    assert "training on 4 rank(s)" in out
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert digests[0] == digests[2] and digests[1] == digests[3], "replicas of one slice differ"
    assert digests[0] != digests[1], "the two ranks of a tensor-parallel group hold the same weights"
    # rank 0's checkpoint folder: each rank of the first replica writes its slices into it
    assert not list((tmp_path / "tp2dp2").glob("rank[123]/checkpoints/*")), "a checkpoint outside rank 0's folder"
    [saved] = (tmp_path / "tp2dp2" / "rank0" / "checkpoints").glob(f"ckpt-{epochs[1]['step']:09d}")
    # the two slices of the first replica; the second replica writes nothing
    assert {p.name for p in saved.iterdir()} == {"index.json", "rank-00000.safetensors", "rank-00001.safetensors"}
    # the unsplit q, k, v projection and MLP output (torch: (out, in); Keras: (in, out)), no slices
    whole = {(48, 16), (16, 64)} if framework == "torch" else {(16, 48), (64, 16)}
    assert whole <= sharded_shapes(saved)
    assert not {(24, 16), (16, 32), (16, 24), (32, 16)} & sharded_shapes(saved)


# An edit a user might make to the generated Block: a scale on the MLP's residual branch.
RESIDUAL_EDIT = {
    "torch": ("        return x + self.mlp(self.norm2(x))", "        return x + 0.5 * self.mlp(self.norm2(x))"),
    "tensorflow": ("        return x + self.dropout(self.out(self.fc(self.norm2(x))), training=training)",
                   "        return x + 0.5 * self.dropout(self.out(self.fc(self.norm2(x))), training=training)"),
}


@pytest.mark.parametrize("saved_at, resumed_at", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_checkpoint_resumes_at_another_tp_on_the_same_losses(tmp_path, framework, saved_at, resumed_at):
    """-np = tp, one replica: both runs read the same batches, so the resumed epoch 2 must be the
    straight run's epoch 2 (a slice gathered to the wrong place would load another model).

    model.py's Block is edited first (its MLP branch scaled by 0.5): the split swaps the block's
    linear layers and runs the block's own forward (Keras `call`), so the edited model is what
    trains at tp 2. A split block of its own would train the unedited block at tp 2, and the epoch
    trained there would not be the tp 1 run's."""
    project, args = generate(tmp_path, framework)
    model_py = project / "model.py"
    assert model_py.read_text().count(RESIDUAL_EDIT[framework][0]) == 1
    model_py.write_text(model_py.read_text().replace(*RESIDUAL_EDIT[framework]))
    straight, _, _ = train(saved_at, project, tmp_path / "straight", 2, *args, "--parallel.tp", str(saved_at))
    steps = straight[0]["step"]
    [saved] = (tmp_path / "straight" / "rank0" / "checkpoints").glob(f"ckpt-{steps:09d}*")
    copy_checkpoint(saved, tmp_path / "resumed" / "rank0" / "checkpoints")
    resumed, out, _ = train(resumed_at, project, tmp_path / "resumed", 2, *args, "--parallel.tp", str(resumed_at))
    assert f"resuming from checkpoints/{saved.name}: epoch 1, step {steps}" in out
    assert [(e["epoch"], e["step"]) for e in resumed] == [(2, straight[1]["step"])]
    for key in ("train_loss", "train_accuracy", "val_loss", "val_perplexity"):
        assert resumed[0][key] == pytest.approx(straight[1][key], rel=1e-5), key


def test_a_zero3_tensor_project_resumes_exactly(tmp_path):
    """horovod.zero 3 on tp 2 x 2 replicas (torch): each rank holds its rows of its slices, so all
    four hold different weights; every rank writes them (the index names the whole tensors), reads
    them back, and the resumed epoch 2 equals the straight run's within 1e-5."""
    project, args = generate(tmp_path, "torch")
    zero = ["--horovod.zero", "3"]
    straight, out, digests = train(4, project, tmp_path / "straight", 2, *args, *zero)
    assert "under ZeRO 3 over 2 replicas" in out
    assert len(set(digests)) == 4, "two ranks hold the same rows of the same slice"
    steps = straight[0]["step"]
    [saved] = (tmp_path / "straight" / "rank0" / "checkpoints").glob(f"ckpt-{steps:09d}*")
    assert {p.name for p in saved.glob("*.safetensors")} == {f"rank-0000{r}.safetensors" for r in range(4)}
    assert {(48, 16), (16, 64)} <= sharded_shapes(saved)
    copy_checkpoint(saved, tmp_path / "resumed" / "rank0" / "checkpoints")
    resumed, out, _ = train(4, project, tmp_path / "resumed", 2, *args, *zero)
    assert f"resuming from checkpoints/{saved.name}: epoch 1, step {steps}" in out
    assert [(e["epoch"], e["step"]) for e in resumed] == [(2, straight[1]["step"])]
    for key in ("train_loss", "train_accuracy", "val_loss", "val_perplexity"):
        assert resumed[0][key] == pytest.approx(straight[1][key], rel=1e-5), key
