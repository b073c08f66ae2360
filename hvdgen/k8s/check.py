"""`hvdgen k8s --check`: validate manifests a user edited, as kubectl would apply them.

Each kustomization under `k8s/` is rendered (base, then every overlay) and every resulting object
is validated; a problem is reported once, under the first folder where it shows. What is checked is
listed in docs/kubernetes.md ("What `--check` checks").
"""

from __future__ import annotations

import sys
from pathlib import Path

from hvdgen.k8s import kustomize
from hvdgen.k8s.documents import ManifestError, decode, load, parse
from hvdgen.k8s.layout import FOLDER
from hvdgen.k8s.problems import Problem
from hvdgen.k8s.validate import documents_problems, job_problems, object_problems


def check_text(text: str, source: str) -> list[Problem]:
    try:
        documents = parse(text, source)
    except ManifestError as exc:
        return [Problem("", str(exc))]
    return [p.where(source) for p in documents_problems(documents)]


def check_file(path: str) -> list[Problem]:
    """Check one file of manifests, or standard input for '-' (e.g. `kubectl kustomize DIR | ...`)."""
    try:
        if path == "-":
            documents = parse(decode(sys.stdin.buffer.read(), "<stdin>"), "<stdin>")
            path = "<stdin>"
        else:
            documents = load(Path(path), path)
    except ManifestError as exc:
        return [Problem("", str(exc))]
    return [p.where(path) for p in documents_problems(documents)]


def check_project(project: Path) -> list[Problem]:
    folder = project / FOLDER
    if not folder.is_dir():
        return [Problem(FOLDER, f"{folder} does not exist: generate it with hvdgen k8s", str(project))]
    directories = sorted({p.parent for p in folder.rglob(kustomize.KUSTOMIZATION)},
                         key=lambda p: (len(p.relative_to(folder).parts), str(p)))
    if not directories:
        return _check_loose_files(project, folder)
    problems: list[Problem] = []
    seen = set()
    for directory in directories:
        source = str(directory.relative_to(project))
        try:
            found = [p.where(source) for p in documents_problems(kustomize.render(directory))]
        except ManifestError as exc:
            found = [Problem(kustomize.KUSTOMIZATION, str(exc), source)]
        for problem in found:
            if (problem.path, problem.message) not in seen:
                seen.add((problem.path, problem.message))
                problems.append(problem)
    return problems


def _check_loose_files(project: Path, folder: Path) -> list[Problem]:
    """No kustomization: each YAML file's objects are checked, and together they must hold the job."""
    problems, documents = [], []
    for path in sorted(folder.rglob("*.y*ml")):
        rel = str(path.relative_to(project))
        try:
            found = load(path, rel)
        except ManifestError as exc:
            problems.append(Problem("", str(exc)))
            continue
        documents += found
        problems += [p.where(rel) for doc in found for p in object_problems(doc)]
    return problems + [p.where(FOLDER) for p in job_problems(documents)]
