"""Write `k8s/` into a project: during `hvdgen new`, and again for `hvdgen k8s` in an existing project.

Re-generating touches `k8s/` and the `k8s:` answers of `.hvdgen.yaml`, nothing else
(hvdgen/regenerate.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hvdgen.k8s.layout import FOLDER, MANAGED, k8s_files
from hvdgen.k8s.options import K8sOptions
from hvdgen.overwrite import refresh_fingerprints
from hvdgen.regenerate import load_spec, rewrite
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


def regenerate(project: Path, opts: K8sOptions) -> list[str]:
    """Re-render k8s/ of `project` with `opts` and record them; returns the paths written.

    Everything is built in memory first, so a refused answer leaves the project untouched.
    """
    spec = dataclasses.replace(load_spec(project, "hvdgen k8s"), k8s=opts.to_answers())
    files = k8s_files(spec, opts)
    written = rewrite(project, spec, [f"{FOLDER}/{rel}" for rel in files], lambda staging: _write(files, staging),
                      "hvdgen k8s")
    _remove_stale(project, written)
    refresh_fingerprints(project, written + [SPEC_FILE], removed=[f"{FOLDER}/{rel}" for rel in MANAGED])
    return written + [SPEC_FILE]


def _remove_stale(project: Path, written: list[str]) -> None:
    """Drop files hvdgen wrote before but not now (the gpu overlay after --gpus-per-worker 0)."""
    for rel in MANAGED:
        path = project / FOLDER / rel
        if f"{FOLDER}/{rel}" not in written and path.is_file():
            path.unlink()
            if path.parent.is_dir() and not any(path.parent.iterdir()):
                path.parent.rmdir()
