"""Regenerate over an existing project (`hvdgen new --force`) without losing anything of the user's.

The new project is rendered in full beside the old one; everything of the user's (runs,
checkpoints, data, `.git`, files they added) is hard-linked into it; then the two folders trade
places in one step (Linux's `renameat2(RENAME_EXCHANGE)`; two renames where the kernel lacks it)
and the old folder is deleted. An interrupted `--force` leaves the old project or the new one,
never a mix, and a path conflict (a folder where the project puts a file) is refused before
anything is touched.

hvdgen's own output is told apart from the user's edits by the fingerprints it records at
generation (FINGERPRINTS). A generated file that still matches is replaced, or removed when the
new project no longer has it. A file the user changed is replaced as well, but their version is
kept beside it as `<name>.orig` and named on the terminal; a changed file the new project no
longer has is left alone.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hvdgen.errors import HvdgenError

FINGERPRINTS = ".hvdgen-files.yaml"
_HEADER = ("# Written by hvdgen: a fingerprint of each file as generated, so that `hvdgen new --force`\n"
           "# can tell your edits from its own files. Leave it as it is.\n")


def fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def write_fingerprints(root: Path, rels: list[str]) -> None:
    prints = {rel: fingerprint(root / rel) for rel in sorted(rels) if rel != FINGERPRINTS}
    (root / FINGERPRINTS).write_text(_HEADER + yaml.safe_dump(prints, sort_keys=True))


def refresh_fingerprints(root: Path, rewritten: list[str], removed: list[str] = ()) -> None:
    """After hvdgen rewrote some files of a project (`hvdgen k8s`), record those as its own again
    and forget the ones it removed, so a later `--force` does not take them for the user's edits."""
    prints = read_fingerprints(root)
    if not prints:  # a project made before fingerprints: nothing to keep up to date
        return
    for rel in removed:
        if not (root / rel).exists():
            prints.pop(rel, None)
    prints.update({rel: fingerprint(root / rel) for rel in rewritten if (root / rel).is_file()})
    (root / FINGERPRINTS).write_text(_HEADER + yaml.safe_dump(dict(sorted(prints.items())), sort_keys=True))


def read_fingerprints(root: Path) -> dict[str, str]:
    """The recorded fingerprints; none when the file is missing or unreadable (every file then
    counts as possibly the user's)."""
    try:
        data = yaml.safe_load((root / FINGERPRINTS).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


@dataclass
class Plan:
    """What `--force` does to each path of the old project."""

    added: list[str] = field(default_factory=list)        # new files
    unchanged: list[str] = field(default_factory=list)    # same bytes as before
    replaced: list[str] = field(default_factory=list)     # hvdgen's file, new version
    user_changed: list[str] = field(default_factory=list) # replaced; the user's version kept as .orig
    removed: list[str] = field(default_factory=list)      # hvdgen's file, no longer generated
    kept: list[str] = field(default_factory=list)         # no longer generated, but changed by the user

    def lines(self) -> list[str]:
        """One line per path that changes, for the terminal."""
        labels = (("add", self.added), ("replace", self.replaced),
                  ("replace (you changed it; yours is kept as .orig)", self.user_changed),
                  ("remove (no longer generated)", self.removed),
                  ("keep (no longer generated, but you changed it)", self.kept))
        return [f"  {label}: {rel}" for label, rels in labels for rel in rels]


def path_conflict(old: Path, rel: str) -> str | None:
    """Why `rel` cannot be written into `old`, if a path of the user's is in the way."""
    parts = Path(rel).parts
    for depth in range(1, len(parts)):
        here = old.joinpath(*parts[:depth])
        if here.is_symlink() or (here.exists() and not here.is_dir()):
            return f"{here} is a file where the project has a folder"
    target = old / rel
    if target.is_symlink():
        return f"{target} is a symbolic link where the project has a file"
    if target.is_dir():
        return f"{target} is a folder where the project has a file"
    return None


def plan_overwrite(old: Path, new: Path, generated: list[str]) -> Plan:
    """Compare the old project with the freshly rendered one; refuse path conflicts up front."""
    for rel in generated:
        problem = path_conflict(old, rel)
        if problem:
            raise HvdgenError(f"{problem}: move it away, then run hvdgen new --force again")
    recorded = read_fingerprints(old)
    plan = Plan()
    for rel in generated:
        path = old / rel
        if rel == FINGERPRINTS:
            continue
        if not path.exists():
            plan.added.append(rel)
        elif path.read_bytes() == (new / rel).read_bytes():
            plan.unchanged.append(rel)
        elif recorded.get(rel) == fingerprint(path):
            plan.replaced.append(rel)
        else:
            plan.user_changed.append(rel)
    for rel in sorted(set(recorded) - set(generated)):
        path = old / rel
        if path.is_file() and not path.is_symlink():
            (plan.removed if fingerprint(path) == recorded[rel] else plan.kept).append(rel)
    return plan


def _link_or_copy(source: Path, dest: Path) -> None:
    if source.is_symlink():
        os.symlink(os.readlink(source), dest)
        return
    try:
        os.link(source, dest)
    except OSError:  # another filesystem below the project, or one without hard links
        shutil.copy2(source, dest)


def free_name(path: Path, suffix: str = ".orig") -> Path:
    """`path` + suffix, or + suffix2, suffix3...: the first name nothing holds yet."""
    candidate, n = path.with_name(path.name + suffix), 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}{suffix}{n}")
    return candidate


def carry_user_files(old: Path, new: Path, generated: list[str], plan: Plan) -> None:
    """Hard-link into `new` every path of `old` that is the user's, and the .orig copies."""
    skip = set(generated) | set(plan.removed) | {FINGERPRINTS}
    for folder, dirs, files in os.walk(old):
        here = Path(folder)
        rel_dir = here.relative_to(old)
        for name in list(dirs):
            source = here / name
            if source.is_symlink():  # os.walk lists links to folders as folders; carry the link
                _link_or_copy(source, new / rel_dir / name)
                dirs.remove(name)
            else:
                (new / rel_dir / name).mkdir(exist_ok=True)
                shutil.copymode(source, new / rel_dir / name)
        for name in files:
            rel = (rel_dir / name).as_posix()
            if rel not in skip:
                _link_or_copy(here / name, new / rel)
    for rel in plan.user_changed:
        _link_or_copy(old / rel, free_name(new / rel))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> None:
    """Swap two folders' names in one step where the kernel can (Linux >= 3.15, glibc >= 2.28)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        errno = ctypes.get_errno()
        if errno not in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem cannot; fall back
            raise OSError(errno, os.strerror(errno), str(b))
    parked = b.with_name(b.name + ".hvdgen-old")
    os.rename(b, parked)
    try:
        os.rename(a, b)
    except OSError:
        os.rename(parked, b)
        raise
    os.rename(parked, a)


def overwrite(old: Path, new: Path, generated: list[str], plan: Plan) -> None:
    """Make `old` hold the new project plus the user's files; `new` ends up holding the old tree."""
    new.chmod(old.stat().st_mode & 0o7777)
    carry_user_files(old, new, generated, plan)
    exchange(new, old)
