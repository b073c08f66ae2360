"""Build Horovod 0.28.1 against the frameworks installed here, cache the wheel, install it.

Horovod's last release predates current PyTorch and TensorFlow: it asks for C++14 where torch
needs C++17, and its optional XLA ops include a TF header that moved in TF 2.19. PyPI only has
its sdist, so every user compiles it. This module does that once per (horovod, Python, torch,
TF, controllers) combination and keeps the wheel in the user's cache, so the second run of
`hvdgen install-horovod` takes seconds and a wheel is never used against a framework it was not
built for (that fails with a version mismatch at import).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import click

from hvdgen.errors import HvdgenError
from hvdgen.paths import cache_dir

HOROVOD_VERSION = "0.28.1"


@dataclass(frozen=True)
class Patch:
    """A textual fix to the sdist. `old` must be present, so a changed sdist fails loudly."""

    path: str
    old: str
    new: str
    why: str


PATCHES = (
    Patch("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
          "torch >= 2.1 headers need C++17; changing only the torch subdir breaks Gloo at link time"),
    Patch("horovod/torch/CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
          "torch >= 2.1 headers need C++17 (fixed on Horovod master, #3998)"),
    Patch("horovod/tensorflow/CMakeLists.txt",
          'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n', "",
          "optional XLA ops include xla_builder.h, which moved in TF >= 2.19"),
)

# gcc >= 13 no longer pulls <cstdint> in transitively (Horovod master #3957); forcing it in is
# harmless on older compilers.
CXXFLAGS_EXTRA = "-include cstdint"

# What a failed build most likely needs, keyed by a pattern in its log.
FAILURE_HINTS = (
    (r"highwayhash/arch_specific\.h|farmhash\.h",
     "TensorFlow's headers need Debian's libhighwayhash-dev and libfarmhash-dev: "
     "sudo apt-get install -y libhighwayhash-dev libfarmhash-dev"),
    (r"Compatibility with CMake < 3\.5 has been removed",
     "CMake >= 4 refuses Gloo's old minimum: export CMAKE_POLICY_VERSION_MINIMUM=3.5, or pip install 'cmake<4'"),
    (r"No CMAKE_CXX_COMPILER could be found|g\+\+: not found|c\+\+: not found",
     "install a C++ compiler: sudo apt-get install -y g++"),
    (r"Python\.h: No such file",
     "install the Python headers: sudo apt-get install -y python3-dev"),
    (r"cmake: not found|CMake .* or higher is required|No such file or directory: 'cmake'",
     "pip install 'cmake>=3.18'"),
    (r"c\+\+: fatal error: Killed|Killed signal terminated program",
     "the compiler ran out of memory: rerun with --jobs 1"),
    (r"requires C\+\+17|error: .*is not a member of 'std'",
     "the C++ standard patch did not take: rerun with --force; if it persists, report the log"),
)


@dataclass(frozen=True)
class BuildTarget:
    """Everything a Horovod binary depends on; two targets with the same key share one wheel."""

    python: str
    torch: str | None
    tensorflow: str | None
    mpi: bool
    nccl: bool

    @property
    def key(self) -> str:
        parts = [f"horovod{HOROVOD_VERSION}", f"py{self.python}",
                 f"torch{self.torch or '-none'}", f"tf{self.tensorflow or '-none'}", "gloo"]
        if self.mpi:
            parts.append("mpi")
        if self.nccl:
            parts.append("nccl")
        return "_".join(parts)

    @property
    def frameworks(self) -> list[str]:
        return [name for name, version in (("PyTorch", self.torch), ("TensorFlow", self.tensorflow)) if version]


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _torch_has_cuda() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
                           capture_output=True, text=True)
    return bool(probe.stdout.strip())


def detect_target() -> BuildTarget:
    """Read framework versions from package metadata (no framework import) and probe the toolchain."""
    torch = _dist_version("torch")
    tensorflow = _dist_version("tensorflow") or _dist_version("tensorflow-cpu")
    if not torch and not tensorflow:
        raise HvdgenError("neither torch nor tensorflow is installed: pip install torch==2.13.0 "
                          "(or tensorflow) first, then rerun hvdgen install-horovod")
    mpi = shutil.which("mpicxx") is not None
    nccl = bool(torch) and shutil.which("nvcc") is not None and _torch_has_cuda()
    return BuildTarget(python=f"{sys.version_info.major}{sys.version_info.minor}",
                       torch=torch, tensorflow=tensorflow, mpi=mpi, nccl=nccl)


def wheel_cache_dir(target: BuildTarget) -> Path:
    return cache_dir() / "horovod-wheels" / target.key


def cached_wheel(target: BuildTarget) -> Path | None:
    wheels = sorted(wheel_cache_dir(target).glob("horovod-*.whl"))
    return wheels[-1] if wheels else None


def installed_wheel_url() -> str | None:
    """The wheel pip installed horovod from, as recorded in its direct_url.json."""
    try:
        text = metadata.distribution("horovod").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return json.loads(text).get("url") if text else None


def imports_cleanly(target: BuildTarget) -> bool:
    modules = [m for m, v in (("horovod.torch", target.torch), ("horovod.tensorflow", target.tensorflow)) if v]
    code = "; ".join(f"import {m}" for m in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def apply_patches(source: Path) -> None:
    for patch in PATCHES:
        path = source / patch.path
        text = path.read_text()
        if patch.old not in text:
            raise HvdgenError(f"horovod sdist changed: {patch.path} no longer contains {patch.old!r}; "
                              f"hvdgen supports horovod {HOROVOD_VERSION} only")
        path.write_text(text.replace(patch.old, patch.new))


def build_environment(target: BuildTarget, jobs: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "MAKEFLAGS": f"-j{jobs}",
        "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
        "CXXFLAGS": f"{env.get('CXXFLAGS', '')} {CXXFLAGS_EXTRA}".strip(),
    })
    env["HOROVOD_WITH_PYTORCH" if target.torch else "HOROVOD_WITHOUT_PYTORCH"] = "1"
    env["HOROVOD_WITH_TENSORFLOW" if target.tensorflow else "HOROVOD_WITHOUT_TENSORFLOW"] = "1"
    env["HOROVOD_WITH_MPI" if target.mpi else "HOROVOD_WITHOUT_MPI"] = "1"
    if target.nccl:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    return env


def _run_logged(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> int:
    """Run the build, writing every line to the log and showing progress from make's [ NN%]."""
    from tqdm import tqdm

    percent = re.compile(r"\[\s*(\d+)%\]")
    with open(log_path, "w") as log, tqdm(total=100, unit="%", desc="building horovod",
                                          bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}") as bar:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            match = percent.search(line)
            if match:
                bar.update(max(0, int(match.group(1)) - bar.n))
        returncode = proc.wait()
        if returncode == 0:
            bar.update(100 - bar.n)
    return returncode


def explain_failure(log_path: Path, tail_lines: int = 40) -> str:
    text = log_path.read_text(errors="replace")
    tail = "\n".join(text.splitlines()[-tail_lines:])
    hints = [hint for pattern, hint in FAILURE_HINTS if re.search(pattern, text)]
    advice = hints[0] if hints else f"read the full log at {log_path}"
    return f"{tail}\n\nhorovod build failed; likely fix: {advice} (full log: {log_path})"


def build_wheel(target: BuildTarget, jobs: int) -> Path:
    """Fetch the sdist, patch it, build one wheel against the installed frameworks, cache it."""
    dest = wheel_cache_dir(target)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log_path = dest.parent / f"{target.key}.build.log"
    with tempfile.TemporaryDirectory(prefix="hvdgen-horovod-") as tmp:
        work = Path(tmp)
        click.echo(f"fetching horovod {HOROVOD_VERSION} sdist from PyPI")
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                  "-d", str(work), f"horovod=={HOROVOD_VERSION}"], capture_output=True, text=True)
        if fetched.returncode != 0:
            raise HvdgenError(f"could not download the horovod sdist: {fetched.stderr.strip().splitlines()[-1:]}; "
                              "check that PyPI is reachable (pip config list)")
        sdist = next(work.glob("horovod-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = work / f"horovod-{HOROVOD_VERSION}"
        apply_patches(source)
        out = work / "wheel"
        click.echo(f"building for {', '.join(target.frameworks)} (key {target.key}); log: {log_path}")
        started = time.monotonic()
        cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", str(out), "."]
        if _run_logged(cmd, build_environment(target, jobs), log_path, cwd=source) != 0:
            raise HvdgenError(explain_failure(log_path))
        click.echo(f"built in {time.monotonic() - started:.0f}s")
        wheel = next(out.glob("horovod-*.whl"))
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dest.parent))
        shutil.move(str(wheel), staging / wheel.name)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)  # atomic: a half-copied wheel is never seen as cached
    return dest / wheel.name


def install_horovod(jobs: int, force: bool) -> Path:
    target = detect_target()
    wheel = None if force else cached_wheel(target)
    if wheel and installed_wheel_url() == wheel.as_uri() and imports_cleanly(target):
        click.echo(f"horovod {HOROVOD_VERSION} is installed from the cached wheel {wheel}")
        return wheel
    if wheel is None:
        wheel = build_wheel(target, jobs)
    else:
        click.echo(f"using cached wheel {wheel}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(wheel)],
                   check=True)
    if not imports_cleanly(target):
        raise HvdgenError(f"horovod from {wheel} does not import; rebuild it: hvdgen install-horovod --force")
    click.echo(f"installed horovod {HOROVOD_VERSION} for {', '.join(target.frameworks)} from {wheel}")
    return wheel
