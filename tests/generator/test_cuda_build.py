"""`hvdgen install-horovod` for a CUDA build of torch, on a machine without a GPU.

The most common GPU set-up is a CUDA torch from pip with no system NCCL: the build must take the
compiler from the CUDA toolkit (here reached through a wrapper script on PATH) and NCCL from pip's
nvidia-nccl wheel, and `horovodrun --check-build` must then list NCCL. Where no compiler can be
found, the command must stop in one line before building anything.

These run in a venv of their own with the CUDA torch from PyPI (the default build there), kept in
hvdgen's cache dir under a key of the Python, torch and hvdgen's own dependencies, so only the first
run pays for it: about 5 minutes of downloads and installs, plus the Horovod build itself (its
wheel is cached under its usual key, shared with any other venv of the same stack). The checkout's
own hvdgen is used through PYTHONPATH, so the venv need not be rebuilt when hvdgen changes.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

from hvdgen import cuda_env
from hvdgen.doctor import parse_check_build
from hvdgen.paths import cache_dir

REPO = Path(__file__).resolve().parents[2]
PYTHON_VERSION = "3.12"  # the 3.11 CPU wheel on this machine's local disk would win on 3.11
CUDA_TORCH = "torch==2.13.0"  # on PyPI the default Linux build is CUDA's
BUILD_TIMEOUT = 3600  # an empty cache: venv (~5 min) + Horovod with CUDA kernels (~4-8 min on 2 cores)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not any(cuda_env.toolkit_at(r, str(r)) for r in cuda_env.DEFAULT_TOOLKIT_ROOTS)
                       and not shutil.which("nvcc"), reason="Requires: a CUDA toolkit (nvcc), no GPU needed"),
]


def find_python(version: str) -> str | None:
    """An interpreter for `version` that really runs (a pyenv shim may exist but not be enabled)."""
    candidates = [shutil.which(f"python{version}"),
                  *sorted(glob.glob(str(Path.home() / f".pyenv/versions/{version}.*/bin/python{version}")))]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return None


def venv_key(python: str) -> str:
    """Changes when the interpreter, the torch spec or hvdgen's declared dependencies change."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = json.dumps([project["dependencies"], project["optional-dependencies"]["build"], CUDA_TORCH])
    version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    return f"cuda-torch-py{version}-{hashlib.sha256(deps.encode()).hexdigest()[:10]}"


def hvdgen_env(venv: Path, **extra: str) -> dict[str, str]:
    """The venv first on PATH, and this checkout's hvdgen ahead of the copy installed in it."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def cuda_venv() -> Path:
    """A venv with the CUDA torch from PyPI and hvdgen's dependencies, made once and then reused."""
    python = find_python(PYTHON_VERSION)
    if python is None:
        pytest.skip(f"Requires: python{PYTHON_VERSION}")
    venv = cache_dir() / "test-venvs" / venv_key(python)
    ready = venv / ".hvdgen-ready"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test session waits instead of building beside it
        if not ready.exists():
            shutil.rmtree(venv, ignore_errors=True)  # a half-made venv from an interrupted run
            subprocess.run([python, "-m", "venv", str(venv)], check=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
            subprocess.run([*pip, CUDA_TORCH, "-e", f"{REPO}[build]"], check=True, timeout=BUILD_TIMEOUT)
            ready.write_text(CUDA_TORCH)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.version.cuda or '')"],
                           capture_output=True, text=True, check=True)
    if not probe.stdout.strip():
        pytest.skip(f"pip installed a CPU torch for {CUDA_TORCH} on Python {PYTHON_VERSION} here")
    return venv


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_cuda_torch_gets_horovod_with_nccl_from_pips_wheel(cuda_venv):
    python = str(cuda_venv / "bin" / "python")
    torch_cuda = subprocess.run([python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True,
                                text=True, check=True).stdout.strip()
    read = subprocess.run([python, "-c", "from hvdgen.cuda_env import torch_cuda_version as v; print(v())"],
                          capture_output=True, text=True, check=True, env=hvdgen_env(cuda_venv)).stdout.strip()
    assert read == torch_cuda  # read from torch/version.py without importing torch

    jobs = str(os.cpu_count() or 1)
    install = subprocess.run([python, "-m", "hvdgen", "install-horovod", "--jobs", jobs], capture_output=True,
                             text=True, env=hvdgen_env(cuda_venv), timeout=BUILD_TIMEOUT)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-6000:]
    assert f"_cuda{torch_cuda}_nccl" in install.stdout  # the cache key names CUDA and NCCL

    check = subprocess.run([str(cuda_venv / "bin" / "horovodrun"), "--check-build"], capture_output=True,
                           text=True, env=hvdgen_env(cuda_venv), timeout=300)
    build = parse_check_build(check.stdout)
    assert build["Tensor Operations"]["NCCL"] is True, check.stdout + check.stderr
    assert build["Frameworks"]["PyTorch"] is True and build["Controllers"]["Gloo"] is True

    doctor = subprocess.run([python, "-m", "hvdgen", "doctor"], capture_output=True, text=True,
                            env=hvdgen_env(cuda_venv), timeout=300)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert f"(CUDA {torch_cuda} build)" in doctor.stdout and "tensor ops   NCCL" in doctor.stdout
    assert "warning" not in doctor.stderr


HOROVOD_CUDA_PROBE = """\
cmake_minimum_required(VERSION 3.18)
project(probe LANGUAGES CXX)
# Horovod's own CMake modules, and its CMakeLists' CUDA and NCCL steps, as in 0.28.1
list(APPEND CMAKE_MODULE_PATH "{modules}/Modules" "{modules}/upstream")
if(DEFINED ENV{{HOROVOD_CUDA_HOME}})
    set(CMAKE_CUDA_COMPILER "$ENV{{HOROVOD_CUDA_HOME}}/bin/nvcc")
endif()
include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
endif()
find_package(CUDAToolkit REQUIRED)
find_package(NCCL REQUIRED)
"""


@pytest.fixture(scope="module")
def horovod_cmake_modules(tmp_path_factory) -> Path:
    """cmake/ of the real horovod sdist: its FindNCCL and the FindCUDAToolkit it vendors."""
    from hvdgen.horovod_build import HOROVOD_VERSION

    work = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "-d", str(work), f"horovod=={HOROVOD_VERSION}"], check=True, timeout=300)
    with tarfile.open(next(work.glob("horovod-*.tar.gz"))) as archive:
        members = [m for m in archive.getmembers() if "/cmake/" in m.name]
        archive.extractall(work, members=members, filter="data")
    return work / f"horovod-{HOROVOD_VERSION}" / "cmake"


def test_horovods_cmake_finds_the_toolkit_behind_a_wrapper_and_pips_nccl_once_told(tmp_path, horovod_cmake_modules):
    """The failure users met: with nvcc on PATH being a wrapper script, Horovod's vendored FindCUDAToolkit
    takes the wrapper's folder for the toolkit; GpuBuild.environment() points it at the real one."""
    toolkit = next(filter(None, (cuda_env.toolkit_at(r, str(r)) for r in cuda_env.DEFAULT_TOOLKIT_ROOTS)), None)
    if toolkit is None:
        pytest.skip("Requires: a CUDA toolkit in /usr/local/cuda")
    wrapper_bin = tmp_path / "wrapper-bin"
    wrapper_bin.mkdir()
    (wrapper_bin / "nvcc").write_text(f'#!/bin/sh\nexec {toolkit.nvcc.resolve()} "$@"\n')
    (wrapper_bin / "nvcc").chmod(0o755)
    site = tmp_path / "site-packages"  # pip's NCCL wheel: nccl.h and libnccl.so.2 only
    (site / "nvidia/nccl/include").mkdir(parents=True)
    (site / "nvidia/nccl/lib").mkdir(parents=True)
    (site / "nvidia/nccl/include/nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 29\n#define NCCL_PATCH 7\n")
    (site / "nvidia/nccl/lib/libnccl.so.2").write_text("")
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(HOROVOD_CUDA_PROBE.format(modules=horovod_cmake_modules))
    cmake = shutil.which("cmake", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    path = f"{wrapper_bin}{os.pathsep}/usr/bin{os.pathsep}/bin"
    plain = {k: v for k, v in os.environ.items() if k not in (*cuda_env.TOOLKIT_VARIABLES, "CUDACXX")}

    def configure(build: str, env: dict[str, str]) -> str:
        (tmp_path / build).mkdir()
        proc = subprocess.run([cmake, str(project)], cwd=tmp_path / build, capture_output=True, text=True,
                              env={**plain, "PATH": path, **env}, timeout=600)
        return proc.stdout + proc.stderr

    without = configure("without", {"HOROVOD_NCCL_HOME": str(site / "nvidia/nccl")})
    assert "Could NOT find CUDAToolkit" in without  # the bug, reproduced

    env = {"PATH": path, "HOROVOD_NCCL_HOME": "", "HOROVOD_NCCL_INCLUDE": "", "HOROVOD_NCCL_LIB": ""}
    gpu = cuda_env.find_gpu_build(toolkit.version, env, sites=[site])
    assert gpu.toolkit.root == toolkit.root.resolve() and gpu.toolkit.found_by == f"{wrapper_bin / 'nvcc'} on PATH"
    told = configure("told", gpu.environment(tmp_path / "cache"))
    assert "Found CUDAToolkit" in told and "Could NOT" not in told, told[-3000:]
    assert f"library: {tmp_path / 'cache'}/nccl-homes/nccl2.29.7-" in told


def _installed_horovod(venv: Path) -> str:
    """Where the venv's horovod came from (empty if none), to show a refusal left it alone."""
    found = list((venv / "lib").glob("python*/site-packages/horovod-*.dist-info/direct_url.json"))
    return found[0].read_text() if found else ""


@pytest.mark.timeout(BUILD_TIMEOUT)
@pytest.mark.parametrize("broken, missing", [
    ({"CUDA_HOME": "{tmp}/nowhere"}, "CUDA_HOME={tmp}/nowhere is not a CUDA toolkit"),
    ({"HOROVOD_NCCL_HOME": "{tmp}/no-nccl"}, "HOROVOD_NCCL_HOME={tmp}/no-nccl has no nccl.h and libnccl"),
], ids=["no-compiler", "no-nccl"])
def test_cuda_torch_without_compiler_or_nccl_is_refused_in_one_line_before_any_build(cuda_venv, tmp_path,
                                                                                      broken, missing):
    path = f"{cuda_venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    extra = {name: value.format(tmp=tmp_path) for name, value in broken.items()}
    if "CUDA_HOME" in extra:
        assert shutil.which("nvcc", path=path) is None  # no compiler to fall back on
    else:
        path = os.environ["PATH"]  # the compiler is there; only NCCL is not
    cache = tmp_path / "cache"
    before = _installed_horovod(cuda_venv)
    proc = subprocess.run([str(cuda_venv / "bin" / "python"), "-m", "hvdgen", "install-horovod"],
                          capture_output=True, text=True, timeout=300,
                          env=hvdgen_env(cuda_venv, PATH=path, HVDGEN_CACHE_DIR=str(cache), **extra))
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1, lines
    assert missing.format(tmp=tmp_path) in lines[0]
    assert lines[0].endswith("or build without GPU ops: hvdgen install-horovod --cpu-only")
    assert not cache.exists()  # nothing downloaded, assembled or built
    assert _installed_horovod(cuda_venv) == before
