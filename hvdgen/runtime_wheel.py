"""The hvdgen runtime as a wheel, written into every generated project.

A generated project imports `hvd_runtime` and its set-up calls `hvdgen install-horovod`, so it
needs this exact hvdgen wherever it goes: another machine, an image build, a CI runner, with or
without an index that serves hvdgen. The project's `pyproject.toml` points at the wheel by a path
relative to itself, and the Dockerfiles copy it into the build.

The wheel is made from the files this hvdgen runs from (a source checkout, or an installed wheel)
with fixed timestamps, order and modes, so it is byte-for-byte the same every time: generating a
project twice, or `--force` over an unchanged one, changes nothing.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from hvdgen import __version__
from hvdgen.errors import HvdgenError
from hvdgen.paths import cache_dir, templates_dir

WHEEL_DIR = "wheels"
DIST = "hvdgen"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip can hold: no build time in the bytes
_WHEEL_FILE = "Wheel-Version: 1.0\nGenerator: hvdgen\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def wheel_name() -> str:
    return f"{DIST}-{__version__}-py3-none-any.whl"


def wheel_relpath() -> str:
    """Where the wheel lies inside a generated project."""
    return f"{WHEEL_DIR}/{wheel_name()}"


def _tree(folder: Path, prefix: str) -> Iterator[tuple[str, Path]]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield f"{prefix}/{path.relative_to(folder).as_posix()}", path


def package_files() -> list[tuple[str, Path]]:
    """(name in the wheel, file on disk) for hvdgen, hvd_runtime and the templates."""
    import hvd_runtime
    import hvdgen

    hvdgen_dir = Path(hvdgen.__file__).resolve().parent
    files = [*_tree(hvdgen_dir, "hvdgen"), *_tree(Path(hvd_runtime.__file__).resolve().parent, "hvd_runtime")]
    if not (hvdgen_dir / "_templates").is_dir():  # a source checkout keeps them beside the packages
        files += _tree(templates_dir(), "hvdgen/_templates")
    return files


def _dist_info() -> dict[str, bytes]:
    """METADATA and entry points as installed (the same whether installed from a wheel or editable)."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:  # `python -m hvdgen` from a source tree on PYTHONPATH
        raise HvdgenError(f"{DIST} is not installed in this Python ({sys.executable}), so the project's "
                          f"runtime wheel has no metadata to copy: pip install -e {Path(__file__).resolve().parent.parent} "
                          "(or pip install hvdgen), then rerun") from None
    info = f"{DIST}-{__version__}.dist-info"
    files = {f"{info}/METADATA": (dist.read_text("METADATA") or "").encode(),
             f"{info}/WHEEL": _WHEEL_FILE.encode()}
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points.encode()
    return files


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _add(archive: zipfile.ZipFile, name: str, data: bytes, executable: bool = False) -> None:
    entry = zipfile.ZipInfo(name, date_time=_EPOCH)
    entry.compress_type = zipfile.ZIP_DEFLATED
    entry.external_attr = (0o100755 if executable else 0o100644) << 16
    archive.writestr(entry, data)


def _sources_fingerprint(files: list[tuple[str, Path]]) -> str:
    """Changes whenever a source file is added, removed or touched (one stat per file), or the
    installed metadata the wheel copies changes (its dependencies, after `pip install -e`)."""
    digest = hashlib.sha256(__version__.encode())
    with contextlib.suppress(HvdgenError):   # not installed: only a build says so (_dist_info)
        for name, data in sorted(_dist_info().items()):
            digest.update(name.encode() + b"\0" + data)
    for name, path in files:
        stat = path.stat()
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def copy_wheel_into(dest_dir: Path) -> Path:
    """Put the runtime wheel into `dest_dir`, built once per hvdgen source state and then copied.

    Building takes a noticeable part of `hvdgen new`; the cache keeps `new` fast. A cache that
    cannot be written (read-only home) only costs the build.
    """
    files = package_files()
    cached = cache_dir() / "runtime-wheels" / _sources_fingerprint(files) / wheel_name()
    if not cached.is_file():
        try:
            cached.parent.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cached.parent.parent))
            try:
                build_wheel(staging, files)
                with contextlib.suppress(OSError):  # another `new` cached the same wheel first
                    staging.rename(cached.parent)  # atomic: a half-written wheel is never taken as cached
            finally:  # gone once renamed; else a duplicate, or what a failed build left
                shutil.rmtree(staging, ignore_errors=True)
        except OSError:
            return build_wheel(dest_dir, files)
    dest_dir.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copyfile(cached, dest_dir / wheel_name()))


def build_wheel(dest_dir: Path, files: list[tuple[str, Path]] | None = None) -> Path:
    """Write the runtime wheel into `dest_dir`; returns its path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / wheel_name()
    record = []
    info = _dist_info()
    with zipfile.ZipFile(target, "w") as archive:
        for name, path in files or package_files():
            data = path.read_bytes()
            _add(archive, name, data, executable=bool(path.stat().st_mode & 0o111))
            record.append(_record_line(name, data))
        for name, data in info.items():
            _add(archive, name, data)
            record.append(_record_line(name, data))
        record_name = f"{DIST}-{__version__}.dist-info/RECORD"
        _add(archive, record_name, ("\n".join([*record, f"{record_name},,"]) + "\n").encode())
    return target
