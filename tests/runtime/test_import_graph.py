"""No import circles in hvd_runtime/ or hvdgen/, read from the modules' own import statements.

Every import counts, a function's too (hiding one in a function is how a circle survives), and
importing `a.b.c` runs `a` and `a.b` first, so those count as well, but for a module's own
packages. A circle is two or more modules that each reach the other through these imports.
"""

from __future__ import annotations

import ast
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
