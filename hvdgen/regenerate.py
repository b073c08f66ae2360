"""Write one folder of an existing project again (`hvdgen k8s`, `hvdgen slurm`), and its answers.

Re-generating touches that folder and `.hvdgen.yaml`, nothing else. Files are written to a
staging folder inside the project first, so a refused answer or a failed write leaves the project
untouched; then each file replaces its old version by an atomic rename.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from hvdgen.errors import HvdgenError
from hvdgen.interrupts import interrupts_held, interrupts_unwind
from hvdgen.spec import SPEC_FILE, ProjectSpec


def load_spec(project: Path, command: str) -> ProjectSpec:
    """The project's recorded answers; anything unreadable is one line saying which file and what to do."""
    path = project / SPEC_FILE
    if project.exists() and not project.is_dir():
        raise HvdgenError(f"--project {project} is a file: give the project folder (the one with {SPEC_FILE})")
    if not path.is_file():
        raise HvdgenError(f"{project} has no {SPEC_FILE}: run {command} inside a project made by hvdgen new, "
                          "or pass --project DIR")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise HvdgenError(f"cannot read {path} ({exc.strerror}): fix its permissions") from exc
    except UnicodeDecodeError as exc:
        raise HvdgenError(f"{path} is not UTF-8 text: restore it (e.g. from version control), or regenerate "
                          "the project with hvdgen new --force") from exc
    return ProjectSpec.from_yaml(text)  # names invalid YAML and missing answers in one line


def rewrite(project: Path, spec: ProjectSpec, targets: list[str], write: Callable[[Path], list[str]],
            command: str) -> list[str]:
    """Write `targets` (paths relative to the project) with `write(folder)`, which returns what it
    wrote there, and `spec` as the answers; returns the paths written. SIGTERM and SIGHUP unwind like
    Ctrl-C, so the staging folder goes on any of them (as for hvdgen new)."""
    answers = spec.to_yaml()
    _refuse_blocked(project, targets + [SPEC_FILE], command)
    staging = None
    try:
        with interrupts_unwind():
            try:
                staging = Path(tempfile.mkdtemp(prefix=f".hvdgen-{command.split()[-1]}-", dir=project))
                written = write(staging)
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
    return written


def _refuse_blocked(project: Path, targets: list[str], command: str) -> None:
    """Before anything moves: a file where a folder goes, or a folder where a file goes, would stop
    the renames halfway and leave the folder half old, half new."""
    for rel in targets:
        dest = project / rel
        if dest.is_dir() and not dest.is_symlink():
            raise HvdgenError(f"{dest} is a folder where {command} writes a file: move it away and run again")
        for parent in (p for p in dest.parents if p != project and p.is_relative_to(project)):
            if parent.exists() and not parent.is_dir():
                raise HvdgenError(f"{parent} is a file where {command} needs a folder: move it away and run again")
