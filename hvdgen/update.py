"""`hvdgen update`: carry a generated project to a newer hvdgen's templates, keeping the user's edits.

Three versions of every generated file meet, as in copier's update:

- base: what the project's own hvdgen generated. The project carries that hvdgen as a wheel
  (wheels/hvdgen-*.whl holds the generator and its templates, not only hvd_runtime), so the base
  is rendered again by it, from the answers in .hvdgen.yaml, in a subprocess;
- yours: the file as it is in the project now;
- new: the same answers rendered by this hvdgen, or by the hvdgen wheel `--to` names.

A file you did not touch takes the new version; a file hvdgen did not change keeps yours; where
both changed, the lines are merged (merge3) and the regions that clash are marked inline
(`<<<<<<< yours` ... `>>>>>>> hvdgen`) or, with `--conflict rej`, left as yours with hvdgen's side
in `<file>.rej`. hvdgen's own records (.hvdgen.yaml, .hvdgen-files.yaml, the runtime wheel)
always take the new version, so the fingerprints keep telling your edits from hvdgen's output.

Nothing is written into the project until every file of the result is staged in a folder beside
it, inside it. Then, with signals held, each file is renamed into place (the user's backups hard-linked aside
first) and the removed ones unlinked; should any step fail, what was done is undone. So a failure,
Ctrl-C or SIGTERM leaves the project byte for byte as it was, and it stays the same folder: a
shell sitting in it (the usual place to run `hvdgen update`) still sees it, where `new --force`'s
swap of whole folders would leave it in the old one.

The contract between hvdgen versions is small: a wheel's `hvdgen.spec.ProjectSpec.from_yaml` reads
the answers and `hvdgen.render.render_tree(spec, folder)` writes the project (RENDER below).
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import click
import merge3

from hvdgen import __version__, runtime_wheel
from hvdgen.catalog import CONFLICT_STYLES
from hvdgen.errors import HvdgenError
from hvdgen.interrupts import interrupts_held, interrupts_unwind
from hvdgen.overwrite import FINGERPRINTS, fingerprint, free_name, path_conflict, refresh_fingerprints
from hvdgen.spec import SPEC_FILE, ProjectSpec

YOURS = "yours"

# Run by another hvdgen (the project's own, or --to's) with that wheel first on sys.path:
# argv = answers file, output folder, "base" (keep the recorded version) or "new" (its own).
RENDER = """
import dataclasses, sys
from pathlib import Path
import hvdgen
from hvdgen.render import render_tree
from hvdgen.spec import ProjectSpec
if not hvdgen.__file__.startswith(sys.argv[4]):
    sys.exit(f"imported hvdgen from {hvdgen.__file__}, not from the wheel unpacked in {sys.argv[4]}")
spec = ProjectSpec.from_yaml(Path(sys.argv[1]).read_text())
if sys.argv[3] == "new":
    spec = dataclasses.replace(spec, hvdgen_version=hvdgen.__version__)
render_tree(spec, Path(sys.argv[2]))
"""


def _is_bookkeeping(rel: str) -> bool:
    """hvdgen's records of the project: always hvdgen's newest, never merged."""
    return rel in (SPEC_FILE, FINGERPRINTS) or rel.startswith(runtime_wheel.WHEEL_DIR + "/")


@dataclass
class UpdatePlan:
    """What the update does to each path; `result` holds every generated path's new bytes."""

    result: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    rejects: dict[str, bytes] = field(default_factory=dict)   # <file>.rej (or .new for binaries) -> content
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)        # hvdgen's, no longer generated, untouched by you
    kept: list[str] = field(default_factory=list)           # no longer generated, but you changed it: stays
    not_restored: list[str] = field(default_factory=list)   # you removed it and hvdgen changed it: stays removed

    def lines(self, conflict: str) -> list[str]:
        marked = ("marked inline: <<<<<<< yours / >>>>>>> hvdgen" if conflict == "inline"
                  else "yours kept, hvdgen's side in <file>.rej")
        labels = (("add", self.added), ("update", self.updated), ("merge (your edits kept)", self.merged),
                  (f"conflict ({marked})", self.conflicts), ("remove (no longer generated)", self.removed),
                  ("keep (no longer generated, but you changed it)", self.kept),
                  ("not restored (you removed it; hvdgen changed it)", self.not_restored))
        return [f"  {label}: {rel}" for label, rels in labels for rel in rels]

    @property
    def changes(self) -> bool:
        return any((self.added, self.updated, self.merged, self.conflicts, self.removed))


def project_wheel(root: Path) -> Path:
    wheels = sorted((root / runtime_wheel.WHEEL_DIR).glob("hvdgen-*.whl"))
    if len(wheels) != 1:
        found = "none" if not wheels else ", ".join(w.name for w in wheels)
        raise HvdgenError(f"{root / runtime_wheel.WHEEL_DIR} must hold the one hvdgen wheel the project was generated "
                          f"with (found {found}): without it there is nothing to update from; regenerate with "
                          "hvdgen new --force")
    return wheels[0]


def _wheel_version(wheel: Path) -> str:
    name = wheel.name.split("-")
    return name[1] if len(name) > 2 else "?"


def target_wheel(to: str | None, work: Path) -> Path:
    """This hvdgen's runtime wheel, a wheel file `to` names, or hvdgen==`to` fetched with pip."""
    if to is None:
        return runtime_wheel.copy_wheel_into(work / "this")
    path = Path(to)
    if path.suffix == ".whl":
        if not path.is_file():
            raise HvdgenError(f"--to {to}: no such wheel file: give an hvdgen wheel, or a version to fetch from PyPI")
        return path.resolve()
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              "-d", str(work / "to"), f"hvdgen=={to}"], capture_output=True, text=True)
    wheels = sorted((work / "to").glob("hvdgen-*.whl"))
    if fetched.returncode != 0 or not wheels:
        last = (fetched.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise HvdgenError(f"--to {to}: pip could not fetch hvdgen=={to} ({last}): give a version your index "
                          "serves, or the path of an hvdgen wheel")
    return wheels[0]


def unpack(wheel: Path, dest: Path) -> Path:
    """Unpack a wheel with its files' modes (zipfile drops them; templates carry executable bits)."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            archive.extract(info, dest)
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                os.chmod(dest / info.filename, mode & 0o777)
    return dest


def render_with(wheel: Path, answers: Path, dest: Path, which: str, work: Path) -> None:
    """Render the project for `answers` into `dest` with the hvdgen inside `wheel`, then put that
    wheel's own bytes where the project keeps it (a wheel rebuilt from unpacked files need not be
    byte-identical to the one pip or another machine made)."""
    code = unpack(wheel, work / f"{which}-hvdgen")
    env = dict(os.environ, PYTHONPATH=str(code), HVDGEN_CACHE_DIR=str(work / f"{which}-cache"),
               PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-c", RENDER, str(answers), str(dest), which, str(code)], cwd=work,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        owner = "the project's own hvdgen" if which == "base" else "the hvdgen to update to"
        raise HvdgenError(f"{owner} ({wheel.name}) could not render the answers in {SPEC_FILE}: {last}: fix "
                          f"{SPEC_FILE}, or regenerate with hvdgen new --force")
    carried = f"{runtime_wheel.WHEEL_DIR}/{wheel.name}"
    if (dest / carried).read_bytes() != wheel.read_bytes():
        shutil.copyfile(wheel, dest / carried)
        refresh_fingerprints(dest, [carried])


def render_here(answers: Path, dest: Path) -> None:
    """The same answers rendered by this hvdgen, in this process."""
    from dataclasses import replace

    from hvdgen.render import check_tree, render_tree

    spec = ProjectSpec.from_yaml(answers.read_text())
    render_tree(replace(spec, hvdgen_version=__version__), dest)
    check_tree(dest)


def files_under(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def _text(data: bytes) -> list[str] | None:
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def _beside(root: Path, rel: str, suffix: str) -> str:
    return free_name(root / rel, suffix).relative_to(root).as_posix()


def merge_file(rel: str, base: bytes, yours: bytes, new: bytes, conflict: str, root: Path,
               plan: UpdatePlan, theirs: str) -> bytes:
    """Both you and hvdgen changed `rel`: merge the lines; returns what the file becomes."""
    lines = [_text(b) for b in (base, yours, new)]
    if any(text is None for text in lines):  # not text: yours stays, hvdgen's beside it
        plan.rejects[_beside(root, rel, ".new")] = new
        plan.conflicts.append(rel)
        return yours
    base_lines, your_lines, new_lines = lines
    merger = merge3.Merge3(base_lines, your_lines, new_lines)
    regions = list(merger.merge_regions())
    if not any(region[0] == "conflict" for region in regions):
        plan.merged.append(rel)
        return "".join(merger.merge_lines()).encode()
    plan.conflicts.append(rel)
    if conflict == "inline":
        return "".join(merger.merge_lines(name_a=YOURS, name_b=theirs,
                                          start_marker="<<<<<<<", mid_marker="=======",
                                          end_marker=">>>>>>>")).encode()
    kept, hunks = [], []
    for region in regions:
        kind = region[0]
        if kind == "unchanged":
            kept += base_lines[region[1]:region[2]]
        elif kind in ("a", "same"):
            kept += your_lines[region[1]:region[2]]
        elif kind == "b":
            kept += new_lines[region[1]:region[2]]
        else:  # conflict: keep yours, hand hvdgen's side to the .rej as a hunk over the original lines
            z1, z2, a1, a2, b1, b2 = region[1:]
            kept += your_lines[a1:a2]
            hunks.append(f"@@ -{z1 + 1},{z2 - z1} +{b1 + 1},{b2 - b1} @@\n"
                         + "".join("-" + _ended(line) for line in base_lines[z1:z2])
                         + "".join("+" + _ended(line) for line in new_lines[b1:b2]))
    plan.rejects[_beside(root, rel, ".rej")] = (f"--- a/{rel}\n+++ b/{rel}\n" + "".join(hunks)).encode()
    return "".join(kept).encode()


def _ended(line: str) -> str:
    return line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


def plan_update(root: Path, base: Path, new: Path, conflict: str, theirs: str = "hvdgen") -> UpdatePlan:
    """Decide every generated path from its three versions (see the module docstring)."""
    plan = UpdatePlan()
    base_files, new_files = files_under(base), files_under(new)
    for rel in sorted(set(base_files) | set(new_files)):
        b = base_files[rel].read_bytes() if rel in base_files else None
        n = new_files[rel].read_bytes() if rel in new_files else None
        path = root / rel
        y = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        if n is None:  # hvdgen no longer generates it
            if y is not None and (y == b or _is_bookkeeping(rel)):
                plan.removed.append(rel)
            elif y is not None:
                plan.kept.append(rel)
            continue
        plan.modes[rel] = new_files[rel].stat().st_mode & 0o777
        if _is_bookkeeping(rel) or y == n:
            plan.result[rel] = n
            if y is None:
                plan.added.append(rel)
            elif y != n:
                plan.updated.append(rel)
        elif y is None:
            if b is None:
                plan.result[rel] = n
                plan.added.append(rel)
            elif b != n:
                plan.not_restored.append(rel)
        elif y == b:
            plan.result[rel] = n
            plan.updated.append(rel)
        elif b == n:
            plan.result[rel] = y
            plan.modes[rel] = path.stat().st_mode & 0o777
        else:
            plan.result[rel] = merge_file(rel, b if b is not None else b"", y, n, conflict, root, plan,
                                           theirs)
            plan.modes[rel] = path.stat().st_mode & 0o777
    return plan


def show_diff(root: Path, plan: UpdatePlan) -> None:
    """What the update would change, as a unified diff against the project on disk."""
    for rel, data in sorted({**plan.result, **plan.rejects}.items()):
        path = root / rel
        old = path.read_bytes() if path.is_file() else b""
        if old == data:
            continue
        old_lines, new_lines = _text(old), _text(data)
        if old_lines is None or new_lines is None:
            click.echo(f"binary file {rel} changes")
            continue
        click.echo("".join(difflib.unified_diff(old_lines, new_lines, f"a/{rel}", f"b/{rel}")), nl=False)
    for rel in plan.removed:
        click.echo(f"remove {rel}")


def stage(staging: Path, root: Path, plan: UpdatePlan) -> list[str]:
    """Write every file that changes into `staging`, with its mode; returns their paths."""
    changed = []
    for rel, data in sorted({**plan.result, **plan.rejects}.items()):
        current = root / rel
        if current.is_file() and current.read_bytes() == data and \
                (current.stat().st_mode & 0o777) == plan.modes.get(rel, 0o644):
            continue
        target = staging / "new" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, plan.modes.get(rel, 0o644))
        changed.append(rel)
    return changed


def commit(staging: Path, root: Path, changed: list[str], removed: list[str]) -> None:
    """Move the staged files into the project and unlink the removed ones, all or nothing.

    Run with signals held. Every file about to be replaced or removed is first hard-linked into
    staging/old, so a step that fails puts each one back and takes the added ones away again.
    """
    backups: list[str] = []
    made_dirs: list[Path] = []
    done: list[str] = []
    try:
        for rel in [*changed, *removed]:
            if (root / rel).exists():
                (staging / "old" / rel).parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(root / rel, staging / "old" / rel)
                except OSError:  # a file system without hard links
                    shutil.copy2(root / rel, staging / "old" / rel)
                backups.append(rel)
        for rel in changed:
            missing = [p for p in (root / rel).parents if not p.exists() and p.is_relative_to(root)]
            for folder in reversed(missing):
                folder.mkdir()
                made_dirs.append(folder)
            os.replace(staging / "new" / rel, root / rel)
            done.append(rel)
        for rel in removed:
            os.unlink(root / rel)
            done.append(rel)
    except OSError:
        for rel in done:
            if rel in backups:
                os.replace(staging / "old" / rel, root / rel)
            else:
                os.unlink(root / rel)
        for folder in reversed(made_dirs):
            folder.rmdir()
        raise


@dataclass
class Outcome:
    versions: str             # "hvdgen 0.1.0 (digest) -> 0.2.0 (digest)"
    plan: UpdatePlan | None   # None: already up to date


def update_project(root: Path, to: str | None = None, conflict: str = "inline", dry_run: bool = False,
                   check_only: bool = False) -> Outcome:
    root = Path(os.path.abspath(root))
    answers = root / SPEC_FILE
    if not answers.is_file():
        raise HvdgenError(f"{root} is not an hvdgen project (no {SPEC_FILE}): run hvdgen update inside a generated "
                          "project, or pass its folder with --project")
    if conflict not in CONFLICT_STYLES:
        raise HvdgenError(f"--conflict {conflict}: choose one of {', '.join(CONFLICT_STYLES)}")
    ours = project_wheel(root)
    staging: Path | None = None
    try:
        with interrupts_unwind():
            work = Path(tempfile.mkdtemp(prefix="hvdgen-update-"))
            try:
                theirs = target_wheel(to, work)
                versions = (f"hvdgen {_wheel_version(ours)} ({fingerprint(ours)}) -> "
                            f"{_wheel_version(theirs)} ({fingerprint(theirs)})")
                if ours.read_bytes() == theirs.read_bytes():
                    return Outcome(versions, None)
                if check_only:
                    return Outcome(versions, UpdatePlan())
                render_with(ours, answers, work / "base", "base", work)
                if to is None:
                    render_here(answers, work / "new")
                else:
                    render_with(theirs, answers, work / "new", "new", work)
                plan = plan_update(root, work / "base", work / "new", conflict, f"hvdgen {_wheel_version(theirs)}")
                for rel in [*plan.result, *plan.rejects]:
                    problem = path_conflict(root, rel)
                    if problem:
                        raise HvdgenError(f"{problem}: move it away, then run hvdgen update again")
                if dry_run or not plan.changes:
                    return Outcome(versions, plan)
                staging = Path(tempfile.mkdtemp(prefix=".hvdgen-update-", dir=root))  # one file system
                changed = stage(staging, root, plan)
                with interrupts_held():
                    commit(staging, root, changed, plan.removed)
                return Outcome(versions, plan)
            finally:
                with interrupts_held():
                    shutil.rmtree(work, ignore_errors=True)
                    if staging is not None:
                        shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise HvdgenError(f"cannot update {root}: {exc.strerror or exc}: check the folder's permissions") from exc
