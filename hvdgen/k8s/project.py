"""Write `k8s/` into a project: during `hvdgen new`, and again for `hvdgen k8s` in an existing project.

Re-generating touches `k8s/` and the `k8s:` answers of `.hvdgen.yaml`, nothing else. Files are
rendered in memory, written to a temporary folder, then each is moved into place by rename.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from hvdgen.errors import HvdgenError
from hvdgen.interrupts import interrupts_held, interrupts_unwind
from hvdgen.overwrite import refresh_fingerprints
from hvdgen.k8s.layout import FOLDER, MANAGED, k8s_files
from hvdgen.k8s.options import K8sOptions
from hvdgen.spec import SPEC_FILE, ProjectSpec


def write_k8s(spec: ProjectSpec, root: Path) -> list[str]:
    """Write k8s/ for `spec` under `root`; returns paths relative to `root`."""
    return _write(k8s_files(spec), root)


def _write(files: dict[str, str], root: Path) -> list[str]:
    written = []
    for rel, text in files.items():
        target = root / FOLDER / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(f"{FOLDER}/{rel}")
    return sorted(written)


def load_spec(project: Path) -> ProjectSpec:
    """The project's recorded answers; anything unreadable is one line saying which file and what to do."""
    path = project / SPEC_FILE
    if project.exists() and not project.is_dir():
        raise HvdgenError(f"--project {project} is a file: give the project folder (the one with {SPEC_FILE})")
    if not path.is_file():
        raise HvdgenError(f"{project} has no {SPEC_FILE}: run hvdgen k8s inside a project made by hvdgen new, "
                          "or pass --project DIR")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise HvdgenError(f"cannot read {path} ({exc.strerror}): fix its permissions") from exc
    except UnicodeDecodeError as exc:
        raise HvdgenError(f"{path} is not UTF-8 text: restore it (e.g. from version control), or regenerate "
                          "the project with hvdgen new --force") from exc
    return ProjectSpec.from_yaml(text)  # names invalid YAML and missing answers in one line


def regenerate(project: Path, opts: K8sOptions) -> list[str]:
    """Re-render k8s/ of `project` with `opts` and record them; returns the paths written.

    Everything is built in memory first, so a refused answer leaves the project untouched; each file
    then replaces its old version by an atomic rename.
    """
    spec = dataclasses.replace(load_spec(project), k8s=opts.to_answers())
    files = k8s_files(spec, opts)
    answers = spec.to_yaml()
    _refuse_blocked(project, [f"{FOLDER}/{rel}" for rel in files] + [SPEC_FILE])
    # SIGTERM and SIGHUP unwind like Ctrl-C, so the staging folder goes on any of them (as for hvdgen new).

    staging = None
    try:
        with interrupts_unwind():
            try:
                staging = Path(tempfile.mkdtemp(prefix=".hvdgen-k8s-", dir=project))
                written = _write(files, staging)
                (staging / SPEC_FILE).write_text(answers)
                for rel in written + [SPEC_FILE]:
                    dest = project / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staging / rel, dest)
            finally:
                with interrupts_held():
                    if staging is not None:
                        shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise HvdgenError(f"cannot write {exc.filename or project} ({exc.strerror}): fix the path or its "
                          "permissions") from exc
    _remove_stale(project, written)
    refresh_fingerprints(project, written + [SPEC_FILE], removed=[f"{FOLDER}/{rel}" for rel in MANAGED])
    return written + [SPEC_FILE]


def _refuse_blocked(project: Path, targets: list[str]) -> None:
    """Before anything moves: a file where a folder goes, or a folder where a file goes, would stop
    the renames halfway and leave k8s/ half old, half new."""
    for rel in targets:
        dest = project / rel
        if dest.is_dir() and not dest.is_symlink():
            raise HvdgenError(f"{dest} is a folder where hvdgen k8s writes a file: move it away and run again")
        for parent in (p for p in dest.parents if p != project and p.is_relative_to(project)):
            if parent.exists() and not parent.is_dir():
                raise HvdgenError(f"{parent} is a file where hvdgen k8s needs a folder: move it away and run again")


def _remove_stale(project: Path, written: list[str]) -> None:
    """Drop files hvdgen wrote before but not now (the gpu overlay after --gpus-per-worker 0)."""
    for rel in MANAGED:
        path = project / FOLDER / rel
        if f"{FOLDER}/{rel}" not in written and path.is_file():
            path.unlink()
            if path.parent.is_dir() and not any(path.parent.iterdir()):
                path.parent.rmdir()
