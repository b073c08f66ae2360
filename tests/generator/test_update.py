"""`hvdgen update` on a project made by an earlier hvdgen, with the user's own edits in it.

fixtures/shop-d67c978.tar.gz is the torch data-parallel MLP project `shop` exactly as hvdgen at
commit d67c978 generated it, before train.py called `parallelize` (made with
`git worktree add OLD d67c978 && PYTHONPATH=OLD python -m hvdgen new shop`). It carries that
hvdgen as its wheel, which is what the update renders the base with; nothing here is mocked.
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import run_horovod
from test_bad_input import snapshot

from hvdgen import runtime_wheel
from hvdgen.cli import main
from hvdgen.overwrite import read_fingerprints
from hvdgen.update import commit

FIXTURE = Path(__file__).parent / "fixtures" / "shop-d67c978.tar.gz"
TEMPLATE_CHANGE = "from hvd_runtime.torch.parallelize import Parallel, parallelize\n"   # what the newer train.py imports
CONFLICTING = "    model.to(ctx.device)  # mine: on the GPU first\n"           # a line the template rewrote


def hvdgen(*args: str, project: Path | None = None):
    return CliRunner().invoke(main, ["update", *(["--project", str(project)] if project else []), *args])


@pytest.fixture
def old_project(tmp_path) -> Path:
    """The fixture unpacked, with the user's edits in train.py, config.yaml and model.py."""
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(tmp_path, filter="data")
    project = tmp_path / "shop"
    train = (project / "train.py").read_text()
    assert TEMPLATE_CHANGE not in train
    config_file = 'CONFIG_FILE = Path(__file__).with_name("config.yaml")\n'
    train = train.replace(config_file, config_file + "import time  # mine: timing\n", 1)
    train = train.replace("    model.to(ctx.device)\n", CONFLICTING, 1)
    (project / "train.py").write_text(train)
    config = (project / "config.yaml").read_text()
    (project / "config.yaml").write_text(config.replace("  epochs: 20\n", "  epochs: 3\n", 1))
    with (project / "model.py").open("a") as model:
        model.write("\n# mine: why the hidden sizes are what they are\n")
    return project


def current_wheel(tmp: Path) -> bytes:
    return runtime_wheel.copy_wheel_into(tmp / "current").read_bytes()


def test_update_keeps_edits_applies_the_templates_and_marks_the_conflict(old_project, tmp_path):
    result = hvdgen(project=old_project)
    assert result.exit_code == 0, result.output
    assert "conflict (marked inline" in result.output and "train.py" in result.output
    train = (old_project / "train.py").read_text()
    assert "import time  # mine: timing\n" in train, "an edit where the template did not change: merged"
    assert TEMPLATE_CHANGE in train, "a template change where the user did not edit: applied"
    yours = train[train.index("<<<<<<< yours\n"):train.index("=======\n")]
    theirs = train[train.index("=======\n"):train.index(">>>>>>> hvdgen 0.1.0\n")]
    assert CONFLICTING in yours and "parallel = parallelize(" in theirs
    assert "  epochs: 3\n" in (old_project / "config.yaml").read_text()
    assert "# mine: why the hidden sizes" in (old_project / "model.py").read_text()
    wheel = old_project / runtime_wheel.wheel_relpath()
    assert wheel.read_bytes() == current_wheel(tmp_path), "the project now carries this hvdgen"
    assert not [p for p in old_project.iterdir() if p.name.startswith(".hvdgen-update-")]

    fresh = CliRunner().invoke(main, ["new", "shop", "--no-input", "-o", str(tmp_path / "fresh")])
    assert fresh.exit_code == 0, fresh.output
    assert read_fingerprints(old_project) == read_fingerprints(tmp_path / "fresh" / "shop"), \
        "the fingerprints are of hvdgen's output, so a later update still tells the user's edits apart"
    assert hvdgen("--check", project=old_project).exit_code == 0

    # The user resolves the conflict by taking hvdgen's side; the merged project trains.
    start, end = train.index("<<<<<<< yours\n"), train.index(">>>>>>> hvdgen 0.1.0\n")
    resolved = train[:start] + theirs.removeprefix("=======\n") + train[end + len(">>>>>>> hvdgen 0.1.0\n"):]
    (old_project / "train.py").write_text(resolved)
    proc = run_horovod(2, [sys.executable, "train.py", "--train.epochs", "1", "--tracking.enabled", "false"],
                       cwd=old_project)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (old_project / "runs" / "latest" / "metrics.jsonl").is_file()


def test_conflict_rej_keeps_yours_and_puts_hvdgens_side_beside_it(old_project):
    result = hvdgen("--conflict", "rej", project=old_project)
    assert result.exit_code == 0, result.output
    train = (old_project / "train.py").read_text()
    assert "<<<<<<<" not in train and CONFLICTING in train and TEMPLATE_CHANGE in train
    rejected = (old_project / "train.py.rej").read_text()
    assert rejected.startswith("--- a/train.py\n+++ b/train.py\n@@ -")
    assert "-    model.to(ctx.device)\n" in rejected and "+    parallel = parallelize(" in rejected


def test_dry_run_shows_the_diff_and_writes_nothing(old_project):
    before = snapshot(old_project.parent)
    result = hvdgen("--dry-run", project=old_project)
    assert result.exit_code == 0, result.output
    assert "+" + TEMPLATE_CHANGE in result.output and "would change, writing nothing now" in result.output
    assert snapshot(old_project.parent) == before


def test_check_says_when_an_update_exists(old_project, tmp_path):
    before = snapshot(old_project.parent)
    result = hvdgen("--check", project=old_project)
    assert result.exit_code == 2 and "an update exists" in result.output
    assert snapshot(old_project.parent) == before
    fresh = CliRunner().invoke(main, ["new", "fresh", "--no-input", "-o", str(tmp_path / "new")])
    assert fresh.exit_code == 0, fresh.output
    current = hvdgen(project=tmp_path / "new" / "fresh")
    assert current.exit_code == 0 and "is up to date" in current.output


def broken_wheel(tmp: Path) -> Path:
    """This hvdgen's wheel with one template that fails to render late in the project."""
    import zipfile

    good = runtime_wheel.copy_wheel_into(tmp / "good")
    bad = tmp / "bad" / good.name
    bad.parent.mkdir()
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(bad, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == "hvdgen/_templates/base/README.md.j2":
                data += b"\n{{ no_such_answer }}\n"
            target.writestr(info, data)
    return bad


def test_a_failure_mid_update_leaves_the_project_byte_for_byte(old_project, tmp_path):
    wheel = broken_wheel(tmp_path)
    before = snapshot(old_project.parent)
    result = hvdgen("--to", str(wheel), project=old_project)
    assert result.exit_code == 1
    message = result.output.strip()
    assert len(message.splitlines()) == 1 and "could not render" in message and "no_such_answer" in message
    assert snapshot(old_project.parent) == before


def test_commit_puts_everything_back_when_a_step_fails(tmp_path):
    root, staging = tmp_path / "project", tmp_path / "project" / ".staging"
    (root / "keep").mkdir(parents=True)
    (root / "a.txt").write_text("old a")
    (root / "gone.txt").write_text("hvdgen's, to be removed")
    (staging / "new" / "sub").mkdir(parents=True)
    (staging / "new" / "a.txt").write_text("new a")
    (staging / "new" / "sub" / "added.txt").write_text("added")
    def project_files():
        return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and staging not in p.parents}

    before = project_files()
    # z.txt was never staged: its rename fails after a.txt and sub/added.txt have moved in.
    with pytest.raises(FileNotFoundError):
        commit(staging, root, ["a.txt", "sub/added.txt", "z.txt"], ["gone.txt"])
    assert project_files() == before
    assert not (root / "sub").exists(), "the folder made for the added file is gone again"


@pytest.mark.parametrize("case", ["not a project", "no wheel", "no such wheel"])
def test_bad_input_is_one_line_and_writes_nothing(case, old_project):
    args = []
    project = old_project
    if case == "not a project":
        project = old_project / "docs"
    elif case == "no wheel":
        (old_project / runtime_wheel.wheel_relpath()).unlink()
    else:
        args = ["--to", str(old_project / "missing.whl")]
    before = snapshot(old_project.parent)
    result = hvdgen(*args, project=project)
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1, result.output
    expected = {"not a project": "is not an hvdgen project", "no wheel": "must hold the one hvdgen wheel",
                "no such wheel": "no such wheel file"}[case]
    assert expected in result.output
    assert snapshot(old_project.parent) == before
