"""`hvdgen new --force` over an existing project: the new project is swapped in whole, the user's
files and edits survive, files that no longer belong go only if untouched, and `--dry-run` says
all of it without touching anything."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from test_bad_input import snapshot

from hvdgen.cli import main
from hvdgen.overwrite import FINGERPRINTS, read_fingerprints


def new(tmp: Path, *args: str):
    result = CliRunner().invoke(main, ["new", "proj", "-o", str(tmp), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_generation_records_a_fingerprint_of_every_file(tmp_path):
    result = new(tmp_path)
    project = tmp_path / "proj"
    prints = read_fingerprints(project)
    on_disk = {p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()}
    assert set(prints) == on_disk - {FINGERPRINTS}
    assert "train.py" in prints and "wheels/hvdgen-0.1.0-py3-none-any.whl" in prints
    assert f" {len(on_disk)} files)" in result.output


def test_the_same_answers_again_change_nothing(tmp_path):
    new(tmp_path)
    before = snapshot(tmp_path)
    result = new(tmp_path, "--force")
    assert "(no generated file changed)" in result.output
    assert snapshot(tmp_path) == before, "the runtime wheel and every file come out byte for byte the same"


def test_force_keeps_the_users_files_and_edits(tmp_path):
    new(tmp_path, "--elastic")
    project = tmp_path / "proj"
    (project / "train.py").write_text("# my own loop\n")
    (project / "runs").mkdir()
    (project / "runs" / "metrics.jsonl").write_text("{}\n")
    (project / "tests" / "test_mine.py").write_text("def test_mine(): pass\n")
    (project / "latest").symlink_to("runs")
    inode = (project / "runs" / "metrics.jsonl").stat().st_ino

    result = new(tmp_path, "--force")

    assert "replace (you changed it; yours is kept as .orig): train.py" in result.output
    assert "warning: you had changed train.py" in result.stderr
    assert (project / "train.py.orig").read_text() == "# my own loop\n"
    assert "def main" in (project / "train.py").read_text()
    assert (project / "runs" / "metrics.jsonl").stat().st_ino == inode, "carried by hard link, not copied"
    assert (project / "tests" / "test_mine.py").exists()
    assert (project / "latest").is_symlink()
    assert "remove (no longer generated): discover_hosts.sh" in result.output
    assert not (project / "discover_hosts.sh").exists(), "untouched and no longer generated: removed"
    assert [p.name for p in tmp_path.iterdir()] == ["proj"], "no temporary folder left beside it"


def test_a_changed_file_that_is_no_longer_generated_stays(tmp_path):
    new(tmp_path, "--elastic")
    project = tmp_path / "proj"
    (project / "discover_hosts.sh").write_text("#!/bin/sh\necho node1:4\n")
    result = new(tmp_path, "--force")
    assert "keep (no longer generated, but you changed it): discover_hosts.sh" in result.output
    assert (project / "discover_hosts.sh").read_text() == "#!/bin/sh\necho node1:4\n"


def test_dry_run_force_lists_the_changes_and_writes_nothing(tmp_path):
    new(tmp_path)
    project = tmp_path / "proj"
    (project / "model.py").write_text("# mine\n")
    before = snapshot(tmp_path)
    result = new(tmp_path, "--force", "--dry-run", "--strategy", "model-split")
    assert "--force would change:" in result.output
    assert "replace (you changed it; yours is kept as .orig): model.py" in result.output
    assert "replace: config.yaml" in result.output
    assert snapshot(tmp_path) == before


def test_files_rewritten_by_hvdgen_k8s_stay_hvdgens_own(tmp_path):
    new(tmp_path)
    project = tmp_path / "proj"
    result = CliRunner().invoke(main, ["k8s", "--project", str(project), "--workers", "4", "--gpus-per-worker", "0"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert not (project / "k8s" / "overlays" / "gpu").exists()
    result = new(tmp_path, "--force")
    assert ".orig" not in result.output and "you changed" not in result.output
    assert not list(project.rglob("*.orig"))
