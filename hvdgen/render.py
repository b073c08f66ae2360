"""Render the templates for a ProjectSpec into a temporary tree, check it, then move it into place.

Templates live in `templates/base` (every project) and `templates/<framework>` (framework files
that override or add to base); strategies differ inside one train.py.j2 per framework, its
shared blocks in `templates/base/_train.j2`. Files ending in `.j2` are rendered by a sandboxed Jinja with
StrictUndefined, so a typo in a template fails loudly; others are copied as they are. User strings
reach templates only as data.
"""

from __future__ import annotations

import ast
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2
import yaml
from jinja2.sandbox import SandboxedEnvironment

from hvd_runtime.config import RunConfig
from hvdgen import runtime_wheel
from hvdgen.catalog import FRAMEWORK_PINS
from hvdgen.errors import HvdgenError
from hvdgen.interrupts import interrupts_held, interrupts_unwind
from hvdgen.overwrite import FINGERPRINTS, Plan, overwrite, plan_overwrite, write_fingerprints
from hvdgen.paths import templates_dir
from hvdgen.spec import SPEC_FILE, ProjectSpec

TEMPLATE_SUFFIX = ".j2"
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where present: faster
PARTIAL_PREFIX = "_"  # included by other templates, never written on its own

# Files only some projects get: output path -> whether this spec gets it.
ONLY_WHEN = {
    "discover_hosts.sh": lambda spec: spec.elastic,
    "prepare_tokens.py": lambda spec: spec.model == "gpt",
}


def _layers(spec: ProjectSpec) -> list[Path]:
    """base, then the framework's files."""
    root = templates_dir()
    return [root / "base", root / spec.framework]


def template_files(spec: ProjectSpec) -> dict[str, Path]:
    """Relative output path -> template file; later layers override earlier ones."""
    files: dict[str, Path] = {}
    for layer in _layers(spec):
        for path in sorted(p for p in layer.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            rel = path.relative_to(layer).as_posix().removesuffix(TEMPLATE_SUFFIX)
            if path.name.startswith(PARTIAL_PREFIX):
                continue
            if ONLY_WHEN.get(rel, lambda _: True)(spec):
                files[rel] = path
    return files


def _environment(spec: ProjectSpec) -> SandboxedEnvironment:
    # The framework's layer first: its files win over base's.
    env = SandboxedEnvironment(loader=jinja2.FileSystemLoader([str(p) for p in reversed(_layers(spec))]),
                               undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                               trim_blocks=True, lstrip_blocks=True)
    # A value as YAML writes it on one line: a list in brackets, a plain scalar without the "..." end.
    env.filters["yaml"] = lambda value: ('""' if value == "" else
                                         yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip())
    return env


def context(spec: ProjectSpec) -> dict:
    from hvdgen.slurm.layout import script_context  # refuses a Slurm shape that does not fit, before any write

    return {"slurm": script_context(spec), "spec": spec, "name": spec.name, "package": spec.package, "framework": spec.framework,
            "strategy": spec.strategy, "hvdgen_version": spec.hvdgen_version,
            "runtime_wheel": runtime_wheel.wheel_relpath(), "framework_pin": FRAMEWORK_PINS[spec.framework],
            "defaults": asdict(RunConfig())}  # config.yaml's values where the project makes no choice of its own


def render_tree(spec: ProjectSpec, dest: Path, only: str | None = None) -> list[str]:
    """Write the project for `spec` under `dest`; `only` limits it to one top-level folder."""
    env = _environment(spec)
    ctx = context(spec)
    written = []
    for rel, source in template_files(spec).items():
        if only and not rel.startswith(only.rstrip("/") + "/"):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.name.endswith(TEMPLATE_SUFFIX):
            layer = next(layer for layer in _layers(spec) if source.is_relative_to(layer))
            text = env.get_template(source.relative_to(layer).as_posix()).render(ctx)
            target.write_text(text)
        else:
            shutil.copyfile(source, target)
        shutil.copymode(source, target)
        written.append(rel)
    if only in (None, "k8s"):
        from hvdgen.k8s.project import write_k8s  # built as data, not templated (the tests validate every shape)

        written += write_k8s(spec, dest)
    if only is None:
        runtime_wheel.copy_wheel_into(dest / runtime_wheel.WHEEL_DIR)
        written.append(runtime_wheel.wheel_relpath())
        (dest / SPEC_FILE).write_text(spec.to_yaml())
        written.append(SPEC_FILE)
        write_fingerprints(dest, written)
        written.append(FINGERPRINTS)
    return sorted(written)


def check_tree(root: Path) -> None:
    """Parse every generated Python and YAML file, so a broken template never reaches the user."""
    for path in root.rglob("*"):
        if path.suffix == ".py":
            try:
                ast.parse(path.read_text(), filename=str(path))
            except SyntaxError as exc:
                raise HvdgenError(f"template produced invalid Python in {path.relative_to(root)}: {exc}") from exc
        elif path.suffix in (".yaml", ".yml"):
            try:
                list(yaml.load_all(path.read_text(), Loader=_YAML_LOADER))
            except yaml.YAMLError as exc:
                raise HvdgenError(f"template produced invalid YAML in {path.relative_to(root)}: {exc}") from exc


def target_is_free(target: Path, force: bool) -> None:
    for ancestor in reversed(target.parents):
        if ancestor.exists() and not ancestor.is_dir():
            raise HvdgenError(f"{ancestor} is a file, not a folder: choose another --output")
    if target.exists() and not target.is_dir():
        raise HvdgenError(f"{target} exists and is not a directory: choose another --output or name")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise HvdgenError(f"{target} exists and is not empty: choose another --output, or pass --force to overwrite")


@dataclass
class Generated:
    """What `generate` wrote (or, with dry_run, would write) and, over an existing project, how."""

    files: list[str]
    plan: Plan | None = None


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; return those created, deepest first."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    for path in reversed(missing):
        path.mkdir()
    return missing


def generate(spec: ProjectSpec, target: Path, force: bool = False, dry_run: bool = False) -> Generated:
    """Render into a temp dir beside `target`, check it, then move it into place (or, with
    `force`, swap it with the existing project, keeping the user's files: hvdgen/overwrite.py).

    On any error or SIGINT/SIGTERM/SIGHUP the temp dir and any parent folders made for it are
    removed and `target` is left as it was.
    """
    target = Path(os.path.abspath(target))
    target_is_free(target, force)
    made: list[Path] = []
    staging: Path | None = None
    try:
        with interrupts_unwind():
            try:
                if not dry_run:
                    made = _make_parents(target.parent)
                staging = Path(tempfile.mkdtemp(prefix=".hvdgen-", dir=None if dry_run else target.parent))
                staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the project should not be
                written = render_tree(spec, staging)
                check_tree(staging)
                existing = target.is_dir() and any(target.iterdir())
                plan = plan_overwrite(target, staging, written) if existing else None
                if not dry_run:
                    if plan is None:
                        staging.rename(target)  # atomic on one filesystem; replaces an empty folder
                        staging = None
                    else:
                        overwrite(target, staging, written, plan)  # staging now holds the old tree
                    made = []
                return Generated(written, plan)
            finally:
                with interrupts_held():
                    if staging is not None:
                        shutil.rmtree(staging, ignore_errors=True)
                    for folder in made:
                        _remove_if_empty(folder)
    except OSError as exc:
        raise HvdgenError(f"cannot write {target}: {exc.strerror or exc}: choose another --output") from exc


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
