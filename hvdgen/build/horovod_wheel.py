"""Build Horovod 0.28.1 against the frameworks installed here, cache the wheel, install it.

Horovod's last release predates current PyTorch and TensorFlow: it asks for C++14 where torch
needs C++17, and its optional XLA ops include a TF header that moved in TF 2.19. PyPI only has
its sdist, so every user compiles it. This module does that once per (horovod, patches, Python,
torch, TF, controllers, CUDA, NCCL) combination and keeps the wheel in the user's cache, so the
second run of `hvdgen install-horovod` takes seconds and a wheel is never used against a framework
it was not built for (that fails with a version mismatch at import).

A CUDA build of torch gets NCCL ops, compiled against the toolkit and NCCL that `build.cuda` finds
(pip's NCCL wheel included). When either is missing the command stops before downloading
anything, with one line naming what is missing and the two ways on: install it, or
`--cpu-only`. A CPU-only build on a CUDA torch has its own cache key. TensorFlow beside a CUDA
torch is refused the same way: Horovod compiles GPU ops for all frameworks or none, and its
TensorFlow GPU ops no longer link against TF 2.21 (checked: the build succeeds, the import fails).

Some of TensorFlow's pip headers include `highwayhash/arch_specific.h` and `farmhash.h` without
putting them on its include path (through the XLA headers; with xla_mpi_ops.cc left out, TF
2.21's op source no longer reaches them). TF ships its own copies under `include/external/`, so
the build adds those folders (the versions TF was compiled with) and needs no system packages;
with a TF that lacks them, Debian's libhighwayhash-dev and libfarmhash-dev serve. When neither is
found the command stops before the long build with the one-line apt command. It never runs apt
itself: a Python tool installing system packages as a side effect would surprise whoever owns
the machine.
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
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

import click

from hvdgen.errors import HvdgenError
from hvdgen.build.cuda import (TOOLKIT_VARIABLES, GpuBuild, GpuBuildBlocked, compute_capabilities, find_gpu_build,
                             find_toolkit, site_dirs, torch_cuda_version)
from hvdgen.build.patches import PATCHES, patches_digest
from hvdgen.paths import cache_dir

HOROVOD_VERSION = "0.28.1"


# libstdc++ 13 stopped including these headers from others (GCC 13's porting notes name exactly
# these five), and Horovod 0.28.1 leans on that: <cstdint> (fixed on master, #3957), <string> in
# common/group_table.h, <stdexcept> for common.h's std::logic_error. Seen failing with g++ 13.3
# (Ubuntu 24.04, a CUDA build); forcing them in is harmless on older compilers.
GCC13_DROPPED_HEADERS = ("cstdint", "string", "stdexcept", "system_error", "cstdio")
CXXFLAGS_EXTRA = " ".join(f"-include {header}" for header in GCC13_DROPPED_HEADERS)

# Headers TF's own headers include but leave off its include path -> where TF ships a copy.
TF_UNLISTED_HEADERS = {
    "highwayhash/arch_specific.h": "external/highwayhash",
    "farmhash.h": "external/farmhash_archive/src",
}
TF_HEADERS_FIX = "sudo apt-get install -y libhighwayhash-dev libfarmhash-dev"

# What a failed build most likely needs, keyed by a pattern in its log.
FAILURE_HINTS = (
    (r"highwayhash/arch_specific\.h|farmhash\.h",
     f"TensorFlow's headers need Debian's libhighwayhash-dev and libfarmhash-dev: {TF_HEADERS_FIX}"),
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
    (r"Could NOT find CUDAToolkit|CUDA_TOOLKIT_ROOT_DIR not found|No CMAKE_CUDA_COMPILER could be found",
     "CMake did not find the CUDA toolkit: set CUDA_HOME to it, or build without GPU ops: "
     "hvdgen install-horovod --cpu-only"),
    (r"Could NOT find NCCL",
     "CMake did not find NCCL: pip install nvidia-nccl-cu13 (or set HOROVOD_NCCL_HOME), or build without GPU ops: "
     "hvdgen install-horovod --cpu-only"),
    (r"No matching distribution found for cffi",
     "Horovod's setup.py needs cffi and pip could not fetch it (no index reachable?): pip install cffi, "
     "then rerun (hvdgen's own dependencies bring it)"),
    (r"No matching distribution found for (setuptools|wheel)",
     "the build needs setuptools and wheel installed (it runs without build isolation): "
     "pip install setuptools wheel, then rerun"),
    (r"requires C\+\+17|error: .*is not a member of 'std'",
     "the C++ standard patch did not take: rerun with --force; if it persists, report the log"),
)


@dataclass(frozen=True)
class BuildTarget:
    """Everything a Horovod binary depends on; two targets with the same key share one wheel.

    `cuda` and `nccl` are the toolkit and NCCL versions the GPU ops are compiled against (None: no
    GPU ops); `cpu_only` marks a build that leaves them out of a CUDA torch on request, which must
    not be mistaken for the NCCL wheel of the same torch. `cuda_arch` narrows Horovod's CUDA
    kernels to these compute capabilities (empty: every one the toolkit knows, a wheel for any GPU).
    """

    python: str
    torch: str | None
    tensorflow: str | None
    mpi: bool
    cuda: str | None = None
    nccl: str | None = None
    cpu_only: bool = False
    cuda_arch: tuple[int, ...] = ()
    patches: str = field(default_factory=patches_digest)

    @property
    def key(self) -> str:
        parts = [f"horovod{HOROVOD_VERSION}-p{self.patches}", f"py{self.python}",
                 f"torch{self.torch or '-none'}", f"tf{self.tensorflow or '-none'}", "gloo"]
        if self.mpi:
            parts.append("mpi")
        if self.cuda:
            parts.append(f"cuda{self.cuda}")
        if self.nccl:
            parts.append(f"nccl{self.nccl}")
        if self.cpu_only:
            parts.append("cpu-only")
        if self.cuda_arch:
            parts.append("sm" + "-".join(map(str, self.cuda_arch)))
        return "_".join(parts)

    @property
    def frameworks(self) -> list[str]:
        return [name for name, version in (("PyTorch", self.torch), ("TensorFlow", self.tensorflow)) if version]


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


CPU_ONLY_WAY = "or build without GPU ops: hvdgen install-horovod --cpu-only"
# Why a CUDA torch gets no NCCL ops while TensorFlow is installed (doctor says it too).
NCCL_WITH_TENSORFLOW = (f"Horovod {HOROVOD_VERSION} builds NCCL ops for every framework at once, and its TensorFlow "
                        "GPU ops do not load with current TensorFlow (checked with 2.21: "
                        "stream_executor::gpu::AsGpuStreamValue is gone)")


def parse_cuda_arch(text: str, supported: list[int], cuda: str) -> tuple[int, ...]:
    """'90' or '8.0,9.0' -> (80, 90), each one a compute capability this toolkit compiles for."""
    try:
        wanted = sorted({int(round(float(part) * 10)) if "." in part else int(part)
                         for part in text.replace(" ", "").split(",") if part})
    except ValueError:
        wanted = []
    unknown = [cc for cc in wanted if supported and cc not in supported]
    if not wanted or unknown:
        choices = (f"CUDA {cuda}'s nvcc compiles for {', '.join(map(str, supported))}: pick from those"
                   if supported else "give compute capabilities")
        raise HvdgenError(f"--cuda-arch {text}: {choices}, comma-separated (e.g. 90 for H100, 80 for A100, "
                          "80,90 for both)")
    return tuple(wanted)


def detect_target(cpu_only: bool = False, cuda_arch: str | None = None) -> tuple[BuildTarget, GpuBuild | None]:
    """Read framework versions from package metadata (no framework import) and find the toolchain.

    A CUDA torch gets NCCL ops unless `cpu_only`; if its compiler or NCCL is missing this stops
    here, before anything is downloaded or built, with the one line GpuBuildBlocked composes.
    `cuda_arch` (only for GPU ops) is checked against what the toolkit found compiles for.
    """
    torch = _dist_version("torch")
    tensorflow = _dist_version("tensorflow") or _dist_version("tensorflow-cpu")
    if not torch and not tensorflow:
        raise HvdgenError("neither torch nor tensorflow is installed: pip install torch==2.13.0 "
                          "(or tensorflow) first, then rerun hvdgen install-horovod")
    target = BuildTarget(python=f"{sys.version_info.major}{sys.version_info.minor}", torch=torch,
                         tensorflow=tensorflow, mpi=shutil.which("mpicxx") is not None)
    cuda = torch_cuda_version() if torch else None
    if cuda_arch and (cuda is None or cpu_only):
        why = "--cpu-only leaves GPU ops out" if cuda is not None else "torch is a CPU build"
        raise HvdgenError(f"--cuda-arch {cuda_arch} selects GPUs for Horovod's CUDA kernels, but this build has none "
                          f"({why}): drop --cuda-arch (and unset HVDGEN_CUDA_ARCH)")
    if cuda is None:
        return target, None
    if cpu_only:
        return replace(target, cpu_only=True), None
    if tensorflow:
        raise HvdgenError(f"TensorFlow {tensorflow} is installed beside a CUDA build of torch: "
                          f"{NCCL_WITH_TENSORFLOW}: build NCCL in a venv without TensorFlow, {CPU_ONLY_WAY}")
    try:
        gpu = find_gpu_build(cuda)
    except GpuBuildBlocked as blocked:
        raise HvdgenError(f"{blocked}, {CPU_ONLY_WAY}") from None
    archs = parse_cuda_arch(cuda_arch, compute_capabilities(gpu.toolkit.nvcc), gpu.toolkit.version) if cuda_arch else ()
    return replace(target, cuda=gpu.toolkit.version, nccl=gpu.nccl.version, cuda_arch=archs), gpu


def wheel_cache_dir(target: BuildTarget) -> Path:
    return cache_dir() / "horovod-wheels" / target.key


def cached_wheel(target: BuildTarget) -> Path | None:
    """The wheel built for exactly this target, else one built for it plus another framework.

    Each framework's Horovod extension is a library of its own that loads only when imported, so
    a wheel built for torch and TensorFlow serves a torch-only (or TF-only) environment with the
    same Python, the same version of its framework, controllers, GPU toolchain and patches: a
    project's fresh virtualenv then reuses the build its developer already has.
    """
    wheels = sorted(wheel_cache_dir(target).glob("horovod-*.whl"))
    if wheels:
        return wheels[-1]
    if target.cuda_arch:  # kernels for every GPU include these
        return cached_wheel(replace(target, cuda_arch=()))
    pattern = target.key
    if target.torch is None:
        pattern = pattern.replace("_torch-none_", "_torch*_")
    if target.tensorflow is None:
        pattern = pattern.replace("_tf-none_", "_tf*_")
    if pattern == target.key:
        return None
    wheels = sorted((cache_dir() / "horovod-wheels").glob(f"{pattern}/horovod-*.whl"))
    return wheels[-1] if wheels else None


def installed_wheel_url() -> str | None:
    """The wheel pip installed horovod from, as recorded in its direct_url.json."""
    try:
        text = metadata.distribution("horovod").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return json.loads(text).get("url") if text else None


def tensorflow_include_dir() -> Path | None:
    """TF's C++ headers, found from package metadata so TF is not imported."""
    for name in ("tensorflow", "tensorflow-cpu"):
        try:
            path = Path(metadata.distribution(name).locate_file("tensorflow/include"))
        except metadata.PackageNotFoundError:
            continue
        if path.is_dir():
            return path
    return None


def header_found(header: str, include_dirs: list[Path], compiler: str) -> bool:
    """Ask the compiler itself, so its built-in paths, CPATH and CPLUS_INCLUDE_PATH all count."""
    cmd = [compiler, "-E", "-x", "c++", *(f"-I{d}" for d in include_dirs), "-"]
    probe = subprocess.run(cmd, input=f"#include <{header}>\n", capture_output=True, text=True)
    return probe.returncode == 0


def tensorflow_header_dirs(tf_include: Path, compiler: str | None,
                           headers: dict[str, str] = TF_UNLISTED_HEADERS) -> list[Path]:
    """Folders to add to the include path so every header in `headers` resolves.

    TF's shipped copy wins over a system one; a header found nowhere stops the build now, not
    ten minutes in. Without a compiler there is nothing to ask: the build's own hint covers that.
    """
    extra = [tf_include / sub for header, sub in headers.items() if (tf_include / sub / header).is_file()]
    if compiler is None:
        return extra
    missing = [h for h in headers if not header_found(h, [tf_include, *extra], compiler)]
    if missing:
        raise HvdgenError(f"TensorFlow's headers include {' and '.join(missing)}, which neither TensorFlow "
                          f"nor the system provides; install them: {TF_HEADERS_FIX}")
    return extra


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def import_error(target: BuildTarget) -> str | None:
    """The last line of the error importing Horovod for each built framework, None if all import."""
    modules = [m for m, v in (("horovod.torch", target.torch), ("horovod.tensorflow", target.tensorflow)) if v]
    code = "; ".join(f"import {m}" for m in modules)
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]


def imports_cleanly(target: BuildTarget) -> bool:
    return import_error(target) is None


def apply_patches(source: Path) -> None:
    for patch in PATCHES:
        path = source / patch.path
        text = path.read_text()
        if patch.old not in text:
            raise HvdgenError(f"horovod sdist changed: {patch.path} no longer contains {patch.old!r}; "
                              f"hvdgen supports horovod {HOROVOD_VERSION} only")
        path.write_text(text.replace(patch.old, patch.new))


def cpu_only_environment(env: dict[str, str]) -> dict[str, str]:
    """Build variables for a CPU-only build on a CUDA torch.

    Horovod's torch ops still compile CUDA support (no NCCL) whenever torch's own probe finds a
    CUDA_HOME, which it does from CUDA_HOME, any nvcc on PATH or /usr/local/cuda. A toolkit that
    would really build is pointed at explicitly; otherwise the names that would mislead the probe
    into a half-found toolkit are taken out.
    """
    cuda = torch_cuda_version()
    try:
        toolkit = find_toolkit(cuda, env, site_dirs()) if cuda else None
    except GpuBuildBlocked:
        toolkit = None
    if toolkit is not None:
        root = str(toolkit.build_root(cache_dir()))
        return {**env, "CUDA_HOME": root, "HOROVOD_CUDA_HOME": root, "CUDAToolkit_ROOT": root,
                "CUDACXX": str(Path(root) / "bin" / "nvcc")}
    clean = {k: v for k, v in env.items() if k not in TOOLKIT_VARIABLES}
    path = [d for d in env.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvcc").exists()]
    clean["PATH"] = os.pathsep.join(path)
    return clean


def build_environment(target: BuildTarget, jobs: int, include_dirs: list[Path] = (),
                      gpu_env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables Horovod's setup.py and CMake read; `gpu_env` is GpuBuild.environment()'s."""
    env = cpu_only_environment(dict(os.environ)) if target.cpu_only else dict(os.environ)
    env.pop("HOROVOD_GPU_OPERATIONS", None)
    if include_dirs:
        paths = [str(d) for d in include_dirs] + [p for p in env.get("CPLUS_INCLUDE_PATH", "").split(os.pathsep) if p]
        env["CPLUS_INCLUDE_PATH"] = os.pathsep.join(paths)
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
    if target.cuda_arch:
        env["HOROVOD_BUILD_CUDA_CC_LIST"] = ",".join(map(str, target.cuda_arch))
    else:
        env.pop("HOROVOD_BUILD_CUDA_CC_LIST", None)  # the key says every GPU: a stray variable must not narrow it
    for name, value in (gpu_env or {}).items():  # the user's own linker flags stay, ours go after them
        env[name] = f"{env[name]} {value}" if name == "LDFLAGS" and env.get(name) else value
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


def build_wheel(target: BuildTarget, jobs: int, gpu: GpuBuild | None = None) -> Path:
    """Fetch the sdist, patch it, build one wheel against the installed frameworks, cache it."""
    dest = wheel_cache_dir(target)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log_path = dest.parent / f"{target.key}.build.log"
    include_dirs: list[Path] = []
    if target.tensorflow:
        tf_include = tensorflow_include_dir()
        if tf_include is not None:
            include_dirs = tensorflow_header_dirs(tf_include, _compiler())
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
        gpu_env = gpu.environment(cache_dir()) if gpu else None
        if gpu:
            click.echo(f"GPU ops: CUDA {gpu.toolkit.version} at {gpu.toolkit.root} (found through "
                       f"{gpu.toolkit.found_by}), NCCL {gpu.nccl.version} from {gpu.nccl.found_by}")
        click.echo(f"building for {', '.join(target.frameworks)} (key {target.key}); log: {log_path}")
        started = time.monotonic()
        cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", str(out), "."]
        if _run_logged(cmd, build_environment(target, jobs, include_dirs, gpu_env), log_path, cwd=source) != 0:
            raise HvdgenError(explain_failure(log_path))
        click.echo(f"built in {time.monotonic() - started:.0f}s")
        wheel = next(out.glob("horovod-*.whl"))
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dest.parent))
        shutil.move(str(wheel), staging / wheel.name)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)  # atomic: a half-copied wheel is never seen as cached
    return dest / wheel.name


def install_horovod(jobs: int, force: bool, cpu_only: bool = False, cuda_arch: str | None = None) -> Path:
    target, gpu = detect_target(cpu_only, cuda_arch)
    wheel = None if force else cached_wheel(target)
    if wheel and installed_wheel_url() == wheel.as_uri() and imports_cleanly(target):
        click.echo(f"horovod {HOROVOD_VERSION} is installed from the cached wheel {wheel}")
        return wheel
    if wheel is None:
        wheel = build_wheel(target, jobs, gpu)
    else:
        click.echo(f"using cached wheel {wheel}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(wheel)],
                   check=True)
    error = import_error(target)
    if error is not None:
        shutil.rmtree(wheel.parent, ignore_errors=True)  # never offer a wheel that does not import again
        raise HvdgenError(f"horovod from {wheel} does not import ({error}); it is removed from the cache: "
                          "rerun hvdgen install-horovod to rebuild it, and report this error if it persists")
    click.echo(f"installed horovod {HOROVOD_VERSION} for {', '.join(target.frameworks)} from {wheel}")
    return wheel
