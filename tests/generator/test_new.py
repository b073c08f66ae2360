"""`hvdgen new` and `hvdgen list`: validation before writing, atomic output, the answers file."""

import re
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from hvdgen import __version__, catalog
from hvdgen.cli import main
from hvdgen.spec import SPEC_FILE, ProjectSpec


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("name, fragment", [
    ("../x", "not allowed"),
    ("a/b", "not allowed"),
    ("{{x}}", "not allowed"),
    ("", "empty"),
    ("1abc", "not allowed"),
    ("class", "keyword"),
    ("match", "keyword"),
])
def test_bad_names_are_refused_and_nothing_is_written(tmp_path, name, fragment):
    result = run("new", name, "--output", str(tmp_path))
    assert result.exit_code != 0
    message = result.output.strip()
    assert fragment in message
    assert len(message.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, value, fragment", [
    # click.Choice options: the choices are named, and offered by shell completion
    ("--framework", "jax", "Invalid value for '--framework' / '-f': 'jax' is not one of 'torch', 'tensorflow'."),
    ("--strategy", "zero", "'zero' is not one of 'data', 'model-split', 'pipeline', 'tensor'."),
])
def test_unknown_framework_or_strategy_is_refused(tmp_path, option, value, fragment):
    result = run("new", "proj", "--output", str(tmp_path), option, value)
    assert result.exit_code != 0
    assert fragment in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_non_empty_directory_needs_force(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "notes.txt").write_text("mine")
    result = run("new", "proj", "--output", str(tmp_path))
    assert result.exit_code != 0
    assert "--force" in result.output
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["notes.txt"]

    result = run("new", "proj", "--output", str(tmp_path), "--force")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "proj" / "train.py").exists()
    assert (tmp_path / "proj" / "notes.txt").read_text() == "mine"


def test_generated_project_records_its_answers(tmp_path):
    result = run("new", "my-proj", "--output", str(tmp_path))
    assert result.exit_code == 0, result.output
    project = tmp_path / "my-proj"
    answers = yaml.safe_load((project / SPEC_FILE).read_text())
    assert answers["name"] == "my-proj"
    assert answers["framework"] == "torch" and answers["strategy"] == "data"
    assert answers["hvdgen_version"] == __version__
    assert ProjectSpec.from_yaml((project / SPEC_FILE).read_text()).package == "my_proj"
    pyproject = (project / "pyproject.toml").read_text()
    assert f'"hvdgen[torch] @ {{root:uri}}/wheels/hvdgen-{__version__}-py3-none-any.whl"' in pyproject
    assert (project / "wheels" / f"hvdgen-{__version__}-py3-none-any.whl").is_file()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "my-proj"]
    assert leftovers == []


def test_dry_run_writes_nothing(tmp_path):
    result = run("new", "proj", "--output", str(tmp_path), "--dry-run")
    assert result.exit_code == 0
    assert "train.py" in result.output and SPEC_FILE in result.output
    assert list(tmp_path.iterdir()) == []


def test_list_shows_every_combination():
    result = run("list")
    strategies, models = result.output.strip().split("\n\n")
    lines = strategies.splitlines()
    assert len(lines) == len(catalog.FRAMEWORKS) * len(catalog.STRATEGIES)
    assert any(line.startswith("torch") and "data" in line and "available" in line for line in lines)
    for framework in catalog.FRAMEWORKS:  # every schedule its projects can use, and no other
        pipeline = next(line for line in lines if line.split()[:2] == [framework, "pipeline"])
        named = set(re.findall(r"[\w-]+", pipeline.partition("(")[2].partition(")")[0]))
        assert named == set(catalog.schedules(framework)), pipeline
    model_lines = models.splitlines()[1:]
    assert [line.split()[0] for line in model_lines] == ["mlp", "resnet18", "gpt"]


@pytest.mark.parametrize("args,problem", [
    (["--model", "bert"], "Invalid value for '--model' / '-m': 'bert' is not one of 'mlp', 'resnet18', 'gpt'."),
    (["--model", "gpt", "--strategy", "pipeline", "--stages", "7"],
     "--stages 7 is more than the 6 blocks of the generated gpt (embedding, 4 transformer layers, head): use "
     "--stages 6 or fewer; for more, add transformer layers (config.yaml model.layers)"),
    (["--size", "gpt2-small"], "--size gpt2-small is a size of the GPT, and the mlp model has one: use --model gpt, "
                               "or leave --size out"),
    (["--model", "gpt", "--size", "gpt2-small", "--strategy", "pipeline", "--stages", "15"],
     "--stages 15 is more than the 14 blocks of the generated gpt (embedding, 12 transformer layers, head)"),
    (["--model", "gpt", "--size", "gpt2-small", "--strategy", "tensor", "--tp", "8"],
     "--tp 8 does not divide the generated gpt's 12 attention heads"),
    (["--model", "gpt", "--size", "huge"], "Invalid value for '--size': 'huge' is not one of 'tiny', 'gpt2-small'."),
    (["--zero", "4"], "Invalid value for '--zero': 4 is not in the range 0<=x<=3."),
    (["--zero", "1", "--strategy", "model-split"],
     "--zero 1 shards a data, tensor or pipeline job, not model-split: drop --zero, or use --strategy data"),
    (["--zero", "3", "--framework", "tensorflow"],
     "--zero 3 with --framework tensorflow: Keras shards a data-parallel job's optimizer state and gradients "
     "(--zero 1 or 2, --strategy data); use --framework torch for more"),
    (["--zero", "1", "--framework", "tensorflow", "--strategy", "pipeline"],
     "--zero 1 with --framework tensorflow: Keras shards a data-parallel job's"),
    (["--zero", "2", "--strategy", "pipeline"], "--zero 2 with --strategy pipeline: every micro-batch's backward "
                                                "would reduce-scatter again; use --zero 1"),
    (["--zero", "1", "--strategy", "pipeline", "--model", "gpt", "--tp", "2"],
     "--zero 1 with --tp 2: ZeRO shards the stages of a pipeline without tensor parallelism; drop one of them"),
    (["--zero", "3", "--elastic"], "--zero 3 with --elastic: a lost worker would take its shard with it; drop one "
                                   "of them"),
])
def test_a_model_that_cannot_be_generated_is_refused_in_one_line(tmp_path, args, problem):
    result = run("new", "proj", "--output", str(tmp_path), *args)
    assert result.exit_code != 0
    assert problem in result.output and result.output.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_gpt2_small_size_starts_the_config_at_gpt2_small(tmp_path):
    """Its parameters are counted in tests/runtime/test_gpt_sizes.py (GPT-2 small's 124,439,808)."""
    result = run("new", "proj", "--output", str(tmp_path), "--model", "gpt", "--size", "gpt2-small",
                 "--strategy", "pipeline", "--stages", "14")
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((tmp_path / "proj" / "config.yaml").read_text())
    assert {k: config["model"][k] for k in ("layers", "heads", "width", "context", "vocab_multiple")} == \
        {"layers": 12, "heads": 12, "width": 768, "context": 1024, "vocab_multiple": 64}
    assert (config["train"]["batch_size"], config["train"]["precision"], config["optim"]["lr"]) == (16, "bf16", 6e-4)
    assert ProjectSpec.from_yaml((tmp_path / "proj" / SPEC_FILE).read_text()).size == "gpt2-small"
    assert "This project starts at **GPT-2 small**" in (tmp_path / "proj" / "README.md").read_text()
    tiny = run("new", "tiny", "--output", str(tmp_path), "--model", "gpt")
    assert tiny.exit_code == 0 and yaml.safe_load((tmp_path / "tiny" / "config.yaml").read_text())["model"]["layers"] == 4
    assert "GPT-2 small**" not in (tmp_path / "tiny" / "README.md").read_text()


def test_zero_is_written_to_the_config_and_the_spec(tmp_path):
    result = run("new", "proj", "--output", str(tmp_path), "--model", "gpt", "--zero", "3")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "proj" / "config.yaml").read_text())["horovod"]["zero"] == 3
    assert ProjectSpec.from_yaml((tmp_path / "proj" / SPEC_FILE).read_text()).zero == 3
    assert "Memory for ranks: `horovod.zero` (ZeRO)" in (tmp_path / "proj" / "README.md").read_text()


def test_cli_starts_without_importing_frameworks():
    code = ("import sys; from hvdgen.cli import main; "
            "heavy = [m for m in ('torch', 'tensorflow', 'mlflow', 'horovod') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_version():
    assert run("--version").output.strip().endswith(__version__)


@pytest.mark.parametrize("args, fragment", [
    (["--stages", "3"], "--stages applies to --strategy model-split or pipeline"),
    (["--strategy", "pipeline", "--stages", "1"], "--stages must be an integer of at least 2"),
    (["--strategy", "pipeline", "--micro-batches", "0"], "--micro-batches must be a positive integer"),
    (["--strategy", "pipeline", "--schedule", "zigzag"],
     "'zigzag' is not one of 'gpipe', '1f1b', 'zb-h1', 'interleaved-1f1b', '1f1b-batched-w'."),
    (["--strategy", "pipeline", "--schedule", "interleaved-1f1b", "--micro-batches", "3"],
     "--micro-batches 3 is not a multiple of --stages 2: --schedule interleaved-1f1b sends micro-batches round the "
     "stages in groups of 2; use --micro-batches 4"),
    (["--strategy", "pipeline", "--schedule", "interleaved-1f1b", "--stages", "3"],
     "cuts the model into --stages 3 x 2 chunks = 6 pieces, more than the 4 blocks of the generated mlp"),
    (["--strategy", "pipeline", "--model", "gpt", "--tp", "2", "--schedule", "interleaved-1f1b"],
     "--schedule interleaved-1f1b does not split stages over tensor-parallel ranks: drop --tp"),
    (["--strategy", "pipeline", "--framework", "tensorflow", "--schedule", "zb-h1"],
     "--schedule zb-h1 runs on PyTorch only: Keras layers inside a block have no hook"),
    (["--strategy", "pipeline", "--framework", "tensorflow", "--schedule", "1f1b-batched-w"],
     "--schedule 1f1b-batched-w runs on PyTorch only: Keras layers inside a block have no hook"),
    (["--strategy", "pipeline", "--elastic"], "--elastic works with the data and model-split"),
])
def test_stage_options_are_validated(tmp_path, args, fragment):
    result = run("new", "proj", "--output", str(tmp_path), *args)
    assert result.exit_code != 0
    assert fragment in result.output and len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("framework", catalog.FRAMEWORKS)
def test_elastic_projects_run_under_hvd_elastic(tmp_path, framework):
    result = run("new", "proj", "--output", str(tmp_path), "--framework", framework, "--elastic")
    assert result.exit_code == 0, result.output
    project = tmp_path / "proj"
    train = (project / "train.py").read_text()
    compile(train, "train.py", "exec")
    assert "metrics = run_elastic(trainer.fit, state, ctx, [train_batches, val_batches]" in train and "state.commit()" in train
    assert "--host-discovery-script ./discover_hosts.sh" in (project / "README.md").read_text()
    assert (project / "discover_hosts.sh").stat().st_mode & 0o111


@pytest.mark.parametrize("schedule, stages", [("gpipe", 3), ("zb-h1", 3), ("interleaved-1f1b", 2), ("1f1b-batched-w", 2)])
def test_stage_options_reach_the_config(tmp_path, schedule, stages):
    result = run("new", "proj", "--output", str(tmp_path), "--strategy", "pipeline", "--stages", str(stages),
                 "--micro-batches", "8", "--schedule", schedule)
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((tmp_path / "proj" / "config.yaml").read_text())
    assert config["parallel"] == {"stages": stages, "micro_batches": 8, "schedule": schedule, "chunks": 2,
                                  "partition": "time"}
    from hvd_runtime.config import load_config    # the runtime takes what the generator wrote
    assert load_config(tmp_path / "proj" / "config.yaml").parallel.schedule == schedule
