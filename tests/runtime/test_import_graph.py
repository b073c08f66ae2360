"""No import circles in hvd_runtime/ or hvdgen/, read from the modules' own import statements;
and no runtime module that generated projects never reach.

Every import counts, a function's too (hiding one in a function is how a circle survives), and
importing `a.b.c` runs `a` and `a.b` first, so those count as well, but for a module's own
packages. A circle is two or more modules that each reach the other through these imports.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in (REPO / package).rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports, with the packages above them
    that importing them runs."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    reached = set()
    for full in names:
        parts = full.split(".")
        for end in range(1, len(parts) + 1):
            module = ".".join(parts[:end])
            if module in known and module != name and not name.startswith(module + "."):
                reached.add(module)
    return reached


def circles(package: str) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm)."""
    known = modules(package)
    edges = {name: sorted(imported(name, path, known)) for name, path in known.items()}
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


@pytest.mark.parametrize("package", ["hvd_runtime", "hvdgen"])
def test_no_import_circles(package):
    assert circles(package) == []


def test_a_circle_through_a_function_level_import_is_found(tmp_path, monkeypatch):
    """The check itself: a circle hidden in a function, and one through a package's __init__."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from pkg.b import thing\n")
    (root / "b.py").write_text("def thing():\n    from pkg import a\n")
    (root / "sub" / "__init__.py").write_text("from pkg.sub.c import x\n")
    (root / "sub" / "c.py").write_text("x = 1\n")
    (root / "d.py").write_text("from pkg.sub.c import x\n")
    (root / "sub" / "e.py").write_text("import pkg.d\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert sorted(circles("pkg")) == [["pkg.a", "pkg.b"]]
    (root / "sub" / "__init__.py").write_text("from pkg.sub.e import *\n")   # pkg.d runs pkg.sub, which imports pkg.d
    assert sorted(circles("pkg")) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub", "pkg.sub.e"]]


# What a generated project runs of hvd_runtime: its files' imports and the `python -m` commands its
# README, Makefile and docs show; what hvdgen itself imports.
PROJECT_USE = re.compile(r"^\s*from\s+(hvd_runtime[\w.]*)\s+import\s+\(?([\w ,]*)|^\s*import\s+(hvd_runtime[\w.]*)"
                         r"|-m\s+(hvd_runtime[\w.]*)", re.M)


def reached_by_projects() -> set[str]:
    """The hvd_runtime modules that templates/ and hvdgen/ use, and every module those import."""
    known = modules("hvd_runtime")
    edges = {name: imported(name, path, known) for name, path in known.items()}
    todo = []
    for path in [*(REPO / "templates").rglob("*"), *(REPO / "hvdgen").rglob("*.py")]:
        if path.is_file():
            for found in PROJECT_USE.finditer(path.read_text(errors="replace")):
                base = found.group(1) or found.group(3) or found.group(4)
                names = [base, *(f"{base}.{n.strip()}" for n in (found.group(2) or "").split(",") if n.strip())]
                todo += [".".join(n.split(".")[:end]) for n in names for end in range(1, n.count(".") + 2)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in known and name not in seen:
            seen.add(name)
            todo += edges[name]
    return seen


def test_every_runtime_module_serves_generated_projects():
    """A module only the tests or bench/ import belongs with them, not in every project's runtime."""
    assert sorted(set(modules("hvd_runtime")) - reached_by_projects()) == []
