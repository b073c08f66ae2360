"""`hvdgen k8s --check`: validate manifests a user edited, as kubectl would apply them.

Each kustomization under `k8s/` is rendered (base, then every overlay) and every resulting object
is validated; a problem is reported once, under the first folder where it shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from hvdgen.k8s import kustomize
from hvdgen.k8s.layout import FOLDER
from hvdgen.k8s.problems import Problem
from hvdgen.k8s.validate import object_problems


def _objects_problems(objects, source: str) -> list[Problem]:
    return [p.where(source) for obj in objects for p in object_problems(obj)]


def check_text(text: str, source: str) -> list[Problem]:
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}" if mark else "(document)"
        return [Problem(line, f"is not valid YAML ({getattr(exc, 'problem', exc)}): fix the indentation or quoting",
                        source)]
    if not documents:
        return [Problem("(document)", "no Kubernetes object found: give a file with an MPIJob", source)]
    return _objects_problems(documents, source)


def check_file(path: str) -> list[Problem]:
    """Check one file of manifests, or standard input for '-' (e.g. `kubectl kustomize DIR | ...`)."""
    if path == "-":
        return check_text(sys.stdin.read(), "<stdin>")
    return check_text(Path(path).read_text(), path)


def check_project(project: Path) -> list[Problem]:
    folder = project / FOLDER
    if not folder.is_dir():
        return [Problem(FOLDER, f"{folder} does not exist: generate it with hvdgen k8s", str(project))]
    directories = sorted({p.parent for p in folder.rglob(kustomize.KUSTOMIZATION)},
                         key=lambda p: (len(p.relative_to(folder).parts), str(p)))
    problems: list[Problem] = []
    if not directories:
        for path in sorted(folder.rglob("*.y*ml")):
            problems += check_text(path.read_text(), str(path.relative_to(project)))
        return problems
    seen = set()
    for directory in directories:
        source = str(directory.relative_to(project))
        try:
            found = _objects_problems(kustomize.render(directory), source)
        except kustomize.RenderError as exc:
            found = [Problem(kustomize.KUSTOMIZATION, str(exc), source)]
        for problem in found:
            if (problem.path, problem.message) not in seen:
                seen.add((problem.path, problem.message))
                problems.append(problem)
    return problems
