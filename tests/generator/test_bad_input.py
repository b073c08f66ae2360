"""Bad input to `hvdgen new` and to commands that read `.hvdgen.yaml`: every row must end with exit
status != 0, exactly one line naming the problem and the fix, and the folder it ran in unchanged,
byte for byte (hidden files, modes and links included). Interrupting `new` by SIGINT, SIGTERM or
SIGHUP, at the moment it has rendered the project, must leave nothing either.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hvdgen.cli import main
from hvdgen.spec import SPEC_FILE


def snapshot(root: Path) -> dict[str, object]:
    """Every path under root with its content, link target or mode: equal snapshots, equal trees."""
    state: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            state[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            state[rel] = ("dir", path.stat().st_mode)
        else:
            state[rel] = ("file", path.stat().st_mode, path.read_bytes())
    return state


def _project(tmp: Path, name: str = "proj", *args: str) -> Path:
    result = CliRunner().invoke(main, ["new", name, "-o", str(tmp), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return tmp / name


def _with_answers(text: str | bytes):
    def prepare(tmp: Path) -> None:
        project = _project(tmp)
        path = project / SPEC_FILE
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return prepare


def _answers_changed(**changes):
    def prepare(tmp: Path) -> None:
        project = _project(tmp)
        answers = yaml.safe_load((project / SPEC_FILE).read_text())
        answers.update(changes)
        (project / SPEC_FILE).write_text(yaml.safe_dump(answers))
    return prepare


def _file(rel: str, content: str = "mine\n"):
    def prepare(tmp: Path) -> None:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(content)
    return prepare


def _existing_project_with(kind: str, rel: str):
    """A generated project where the user put a folder/file/link in the way of a generated path."""
    def prepare(tmp: Path) -> None:
        project = _project(tmp)
        path = project / rel
        if path.is_dir():
            for child in sorted(path.rglob("*"), reverse=True):
                child.rmdir() if child.is_dir() else child.unlink()
            path.rmdir()
        elif path.exists():
            path.unlink()
        if kind == "folder":
            path.mkdir()
            (path / "notes.txt").write_text("mine\n")
        elif kind == "file":
            path.write_text("mine\n")
        else:
            path.symlink_to("/etc/hostname")
    return prepare


def _nothing(tmp: Path) -> None:
    pass


LONG = "a" * 250
K8S = ["k8s", "--project", "proj"]

# (id, prepare, argv). argv runs with the test's folder as the working directory.
CASES = [
    # project names
    ("name-dotdot", _nothing, ["new", "../x"]),
    ("name-slash", _nothing, ["new", "a/b"]),
    ("name-template", _nothing, ["new", "{{x}}"]),
    ("name-empty", _nothing, ["new", ""]),
    ("name-digit-first", _nothing, ["new", "1abc"]),
    ("name-keyword", _nothing, ["new", "class"]),
    ("name-soft-keyword", _nothing, ["new", "match"]),
    ("name-trailing-dash", _nothing, ["new", "a-"]),
    ("name-trailing-underscore", _nothing, ["new", "a_"]),
    ("name-double-dash", _nothing, ["new", "a--b"]),
    ("name-dash-underscore", _nothing, ["new", "a-_b"]),
    ("name-space", _nothing, ["new", "a b"]),
    ("name-non-ascii", _nothing, ["new", "données"]),
    ("name-hvdgen", _nothing, ["new", "hvdgen"]),
    ("name-hvd-runtime", _nothing, ["new", "hvd_runtime"]),
    ("name-torch", _nothing, ["new", "torch"]),
    ("name-tensorflow-any-case", _nothing, ["new", "TensorFlow"]),
    ("name-horovod", _nothing, ["new", "horovod"]),
    ("name-64-chars", _nothing, ["new", "a" * 64]),
    ("name-250-chars", _nothing, ["new", LONG]),
    ("name-250-chars-deep-output", _nothing, ["new", LONG, "-o", "newdir/deep"]),
    # options
    ("framework-unknown", _nothing, ["new", "proj", "--framework", "jax"]),
    ("strategy-unknown", _nothing, ["new", "proj", "--strategy", "zero"]),
    ("stages-on-data", _nothing, ["new", "proj", "--stages", "3"]),
    ("stages-one", _nothing, ["new", "proj", "--strategy", "pipeline", "--stages", "1"]),
    ("stages-above-blocks", _nothing, ["new", "proj", "--strategy", "pipeline", "--stages", "5"]),
    ("stages-not-a-number", _nothing, ["new", "proj", "--strategy", "pipeline", "--stages", "two"]),
    ("micro-batches-zero", _nothing, ["new", "proj", "--strategy", "pipeline", "--micro-batches", "0"]),
    ("micro-batches-above-batch", _nothing, ["new", "proj", "--strategy", "model-split", "--micro-batches", "33"]),
    ("micro-batches-above-gpt2-small-batch", _nothing, ["new", "proj", "--strategy", "pipeline", "--model", "gpt",
                                                         "--size", "gpt2-small", "--micro-batches", "20"]),
    ("schedule-unknown", _nothing, ["new", "proj", "--strategy", "pipeline", "--schedule", "zigzag"]),
    ("schedule-on-model-split", _nothing, ["new", "proj", "--strategy", "model-split", "--schedule", "gpipe"]),
    ("zero-bubble-on-tensorflow", _nothing, ["new", "proj", "--strategy", "pipeline", "--framework", "tensorflow",
                                            "--schedule", "zb-h1"]),
    ("elastic-pipeline", _nothing, ["new", "proj", "--strategy", "pipeline", "--elastic"]),
    ("interleaved-micro-batches-not-a-multiple", _nothing, ["new", "proj", "--strategy", "pipeline", "--schedule",
                                                            "interleaved-1f1b", "--micro-batches", "3"]),
    ("interleaved-more-pieces-than-blocks", _nothing, ["new", "proj", "--strategy", "pipeline", "--schedule",
                                                       "interleaved-1f1b", "--stages", "3"]),
    ("tensor-on-mlp", _nothing, ["new", "proj", "--strategy", "tensor", "--model", "mlp"]),
    ("tensor-tp-not-dividing-heads", _nothing, ["new", "proj", "--strategy", "tensor", "--tp", "3"]),
    ("tensor-tp-one", _nothing, ["new", "proj", "--strategy", "tensor", "--tp", "1"]),
    ("tp-on-data", _nothing, ["new", "proj", "--tp", "2"]),
    ("pipeline-tp-on-mlp", _nothing, ["new", "proj", "--strategy", "pipeline", "--tp", "2"]),
    ("pipeline-tp-not-dividing-heads", _nothing, ["new", "proj", "--strategy", "pipeline", "--model", "gpt", "--tp", "3"]),
    ("pipeline-tp-zero", _nothing, ["new", "proj", "--strategy", "pipeline", "--model", "gpt", "--tp", "0"]),
    ("k8s-pipeline-tp-group-across-workers",
     lambda tmp: _project(tmp, "proj", "--strategy", "pipeline", "--model", "gpt", "--tp", "2"),
     [*K8S, "--gpus-per-worker", "3"]),
    ("k8s-pipeline-tp-partial-pipeline",
     lambda tmp: _project(tmp, "proj", "--strategy", "pipeline", "--model", "gpt", "--tp", "2"), [*K8S, "--workers", "3"]),
    ("stages-on-tensor", _nothing, ["new", "proj", "--strategy", "tensor", "--stages", "2"]),
    ("elastic-tensor", _nothing, ["new", "proj", "--strategy", "tensor", "--elastic"]),
    ("k8s-tensor-group-across-workers", lambda tmp: _project(tmp, "proj", "--strategy", "tensor"),
     [*K8S, "--gpus-per-worker", "3"]),
    ("k8s-tensor-partial-group", lambda tmp: _project(tmp, "proj", "--strategy", "tensor"), [*K8S, "--workers", "3"]),
    ("option-unknown", _nothing, ["new", "proj", "--gpus", "8"]),
    # where it writes
    ("output-under-a-file", _file("afile"), ["new", "proj", "-o", "afile/sub"]),
    ("output-is-a-file", _file("afile"), ["new", "proj", "-o", "afile"]),
    ("target-is-a-file", _file("proj"), ["new", "proj"]),
    ("target-not-empty", _file("proj/notes.txt"), ["new", "proj"]),
    ("output-in-proc", _nothing, ["new", "proj", "-o", "/proc/hvdgen-test"]),
    ("output-in-sysfs", _nothing, ["new", "proj", "-o", "/sys/hvdgen-test"]),
    ("force-folder-where-train-py-goes", _existing_project_with("folder", "train.py"), ["new", "proj", "--force"]),
    ("force-file-where-k8s-goes", _existing_project_with("file", "k8s"), ["new", "proj", "--force"]),
    ("force-link-where-model-py-goes", _existing_project_with("link", "model.py"), ["new", "proj", "--force"]),
    ("force-file-where-docker-goes", _existing_project_with("file", "docker"), ["new", "proj", "--force", "--elastic"]),
    # .hvdgen.yaml, read by hvdgen k8s
    ("answers-missing", _file("proj/train.py"), K8S),
    ("answers-empty", _with_answers(""), K8S),
    ("answers-invalid-yaml", _with_answers("name: [unclosed\n"), K8S),
    ("answers-binary", _with_answers(bytes(range(256))), K8S),
    ("answers-a-list", _with_answers("- name\n- proj\n"), K8S),
    ("answers-no-name", _with_answers("framework: torch\n"), K8S),
    ("answers-unknown-key", _answers_changed(colour="blue"), K8S),
    ("answers-k8s-a-number", _answers_changed(k8s=5), K8S),
    ("answers-elastic-yes-please", _answers_changed(elastic="yes please"), K8S),
    ("answers-stages-a-string", _answers_changed(stages="two"), K8S),
    ("answers-framework-a-list", _answers_changed(framework=["torch"]), K8S),
    ("answers-version-forged-newer", _answers_changed(hvdgen_version="99.0"), K8S),
    ("answers-version-not-a-version", _answers_changed(hvdgen_version="banana"), K8S),
    ("answers-bad-name", _answers_changed(name="../etc"), K8S),
]


@pytest.mark.parametrize("prepare, argv", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(tmp_path, monkeypatch, prepare, argv):
    prepare(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    # In-process: an exception that escapes the CLI fails the test here (catch_exceptions=False).
    result = CliRunner().invoke(main, argv, catch_exceptions=False)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    assert snapshot(tmp_path) == before


def test_the_table_is_at_least_forty_cases():
    assert len(CASES) >= 40


# Deliver a real signal to the real process at the worst moment: the project fully rendered in its
# temporary folder, or (with --force) the user's files half carried into it.
_INTERRUPT_AT = """
import os, signal, sys
import hvdgen.render, hvdgen.overwrite
sig = getattr(signal, sys.argv.pop(1))
where = sys.argv.pop(1)
module, name = (hvdgen.render, "check_tree") if where == "rendered" else (hvdgen.overwrite, "_link_or_copy")
original = getattr(module, name)
calls = []
def interrupted(*args):
    calls.append(1)
    if len(calls) == 2 or where == "rendered":
        os.kill(os.getpid(), sig)
    return original(*args)
setattr(module, name, interrupted)
from hvdgen.cli import main
main(sys.argv[1:], prog_name="hvdgen")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_mid_generation_leaves_nothing(tmp_path, sig):
    before = snapshot(tmp_path)
    result = subprocess.run([sys.executable, "-c", _INTERRUPT_AT, sig, "rendered", "new", "proj", "-o",
                             str(tmp_path / "newdir" / "deep")], capture_output=True, text=True)
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before, "no project, no temporary folder, no parent folder made for it"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_mid_force_leaves_the_old_project(tmp_path, sig):
    project = _project(tmp_path)
    (project / "train.py").write_text("# my own loop\n")
    (project / "runs").mkdir()
    (project / "runs" / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path)
    result = subprocess.run([sys.executable, "-c", _INTERRUPT_AT, sig, "carrying", "new", "proj", "-o",
                             str(tmp_path), "--force", "--elastic"], capture_output=True, text=True)
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before


def test_hvdgen_run_from_a_source_tree_without_its_metadata_is_one_line(tmp_path, monkeypatch):
    """`PYTHONPATH=checkout python -m hvdgen new` (seen on a GPU machine, where pip could not
    install it): the runtime wheel copies hvdgen's installed METADATA, and there is none. The
    distribution lookup is made to fail as it does there; the project folder and the cache stay empty."""
    from importlib import metadata
    from types import SimpleNamespace

    import hvdgen.runtime_wheel

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.setenv("HVDGEN_CACHE_DIR", str(cache))  # empty: the runtime wheel must be built
    # runtime_wheel's own view of importlib.metadata, so nothing else in the process loses its metadata
    monkeypatch.setattr(hvdgen.runtime_wheel, "metadata",
                        SimpleNamespace(distribution=not_installed, PackageNotFoundError=metadata.PackageNotFoundError))
    result = CliRunner().invoke(main, ["new", "proj", "-o", str(work)], catch_exceptions=False)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "hvdgen is not installed in this Python" in lines[0], result.stderr
    assert "pip install -e" in lines[0]
    assert list(work.iterdir()) == []
    assert [p for p in cache.rglob("*") if not p.is_dir()] == []
    assert list(cache.rglob(".staging-*")) == []  # the half-built runtime wheel's folder too
