"""Write `k8s/` into a project: during `hvdgen new`, and again for `hvdgen k8s` in an existing project.

Re-generating touches `k8s/` and the `k8s:` answers of `.hvdgen.yaml`, nothing else. Files are
rendered and validated in a temporary folder first, then each is moved into place by rename.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from hvdgen.errors import HvdgenError
from hvdgen.k8s.layout import FOLDER, MANAGED, k8s_files
from hvdgen.k8s.options import K8sOptions
from hvdgen.spec import SPEC_FILE, ProjectSpec


def write_k8s(spec: ProjectSpec, root: Path) -> list[str]:
    """Write k8s/ for `spec` under `root`; returns paths relative to `root`."""
    written = []
    for rel, text in k8s_files(spec).items():
        target = root / FOLDER / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(f"{FOLDER}/{rel}")
    return sorted(written)


def load_spec(project: Path) -> ProjectSpec:
    path = project / SPEC_FILE
    if not path.is_file():
        raise HvdgenError(f"{project} has no {SPEC_FILE}: run hvdgen k8s inside a project made by hvdgen new, "
                          "or pass --project DIR")
    return ProjectSpec.from_yaml(path.read_text())


def regenerate(project: Path, opts: K8sOptions) -> list[str]:
    """Re-render k8s/ of `project` with `opts` and record them; returns the paths written."""
    spec = dataclasses.replace(load_spec(project), k8s=opts.to_answers())
    staging = Path(tempfile.mkdtemp(prefix=".hvdgen-k8s-", dir=project))
    try:
        written = write_k8s(spec, staging)
        (staging / SPEC_FILE).write_text(spec.to_yaml())
        for rel in written + [SPEC_FILE]:
            dest = project / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_stale(project, written)
    return written + [SPEC_FILE]


def _remove_stale(project: Path, written: list[str]) -> None:
    """Drop files hvdgen wrote before but not now (the gpu overlay after --gpus-per-worker 0)."""
    for rel in MANAGED:
        path = project / FOLDER / rel
        if f"{FOLDER}/{rel}" not in written and path.is_file():
            path.unlink()
            if path.parent.is_dir() and not any(path.parent.iterdir()):
                path.parent.rmdir()
