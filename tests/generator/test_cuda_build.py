"""`hvdgen install-horovod` for a CUDA build of torch, on a machine without a GPU.

The most common GPU set-up is a CUDA torch from pip with no system NCCL: the build must take the
compiler from the CUDA toolkit (here reached through a wrapper script on PATH) and NCCL from pip's
nvidia-nccl wheel, and `horovodrun --check-build` must then list NCCL. Where no compiler can be
found, the command must stop in one line before building anything.

These run in a venv of their own with the CUDA torch from PyPI (the default build there), kept in
hvdgen's cache dir under a key of the Python, torch and hvdgen's own dependencies, so only the first
run pays for it; the Horovod wheel is cached under its usual key, shared with any other venv of the
same stack, and rebuilt when hvdgen's sdist patches change. The checkout's own hvdgen is used
through PYTHONPATH, so the venv need not be rebuilt when hvdgen changes. Measured on 2 cores: empty
cache 38 min while other builds shared the cores (venv 14.5 min, build 23 min); venv cached, wheel
not: 6.5 min; both cached: about 70 s for the whole file.

Cost: over 6% of the suite's CPU on a machine whose cache has neither (docs/testing.md: 252 CPU-s
of 2,573 in a run of 2026-12-02, venv and wheel made then), a few percent once they are cached:
the build is the check, and the cache makes it once per machine.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

import pytest

from hvdgen.build import cuda
from hvdgen.build.checks import parse_check_build
from hvdgen.paths import cache_dir

REPO = Path(__file__).resolve().parents[2]
PYTHON_VERSION = "3.12"  # the 3.11 CPU wheel on this machine's local disk would win on 3.11
CUDA_TORCH = "torch==2.13.0"  # on PyPI the default Linux build is CUDA's
BUILD_TIMEOUT = 3600  # an empty cache: venv (~5 min) + Horovod with CUDA kernels (~4-8 min on 2 cores)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not any(cuda.toolkit_at(r, str(r)) for r in cuda.DEFAULT_TOOLKIT_ROOTS)
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


def system_toolkit() -> cuda.CudaToolkit:
    """The toolkit in its standard place (the one the wrapper nvcc on PATH calls), else skip."""
    toolkit = next(filter(None, (cuda.toolkit_at(r, str(r)) for r in cuda.DEFAULT_TOOLKIT_ROOTS)), None)
    if toolkit is None:
        pytest.skip("Requires: a CUDA toolkit in /usr/local/cuda")
    return toolkit


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
    read = subprocess.run([python, "-c", "from hvdgen.build.cuda import torch_cuda_version as v; print(v())"],
                          capture_output=True, text=True, check=True, env=hvdgen_env(cuda_venv)).stdout.strip()
    assert read == torch_cuda  # read from torch/version.py without importing torch

    jobs = str(os.cpu_count() or 1)
    # One compute capability: the kernels for every GPU the toolkit knows are 24 nvcc passes, the
    # longest part of the build; the default (no --cuda-arch) differs only in that list.
    install = subprocess.run([python, "-m", "hvdgen", "install-horovod", "--jobs", jobs, "--cuda-arch", "9.0"],
                             capture_output=True, text=True, env=hvdgen_env(cuda_venv), timeout=BUILD_TIMEOUT)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-6000:]
    assert f"_cuda{torch_cuda}_nccl" in install.stdout  # the cache key names CUDA and NCCL
    built = re.search(r"\(key (\S+)\); log: (\S+)", install.stdout)
    if built:  # built here: for sm_90 alone, under a key that says so
        assert built.group(1).endswith("_sm90")
        gencode = set(re.findall(r"-gencode arch=compute_(\d+)", Path(built.group(2)).read_text()))
        assert gencode == {"90"}, gencode
    else:  # in the cache already: a wheel for every GPU (sm_90 among them), or this test's sm_90 wheel
        assert re.search(r"(using cached wheel|is installed from the cached wheel) \S+_nccl[\d.]+(_sm90)?/horovod-",
                         install.stdout), install.stdout

    check = subprocess.run([str(cuda_venv / "bin" / "horovodrun"), "--check-build"], capture_output=True,
                           text=True, env=hvdgen_env(cuda_venv), timeout=300)
    build = parse_check_build(check.stdout)
    assert build["Tensor Operations"]["NCCL"] is True, check.stdout + check.stderr
    assert build["Frameworks"]["PyTorch"] is True and build["Controllers"]["Gloo"] is True

    readelf = shutil.which("readelf")
    if readelf:  # horovod.tensorflow loads without torch having loaded pip's NCCL first: it must find it itself
        libs = list((cuda_venv / "lib").glob("python*/site-packages/horovod/torch/mpi_lib_v2*.so"))
        dynamic = subprocess.run([readelf, "-d", str(libs[0])], capture_output=True, text=True, check=True).stdout
        assert "libnccl.so.2" in dynamic and "$ORIGIN/../../nvidia/nccl/lib" in dynamic, dynamic

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
    from hvdgen.build.horovod_wheel import HOROVOD_VERSION

    work = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "-d", str(work), f"horovod=={HOROVOD_VERSION}"], check=True, timeout=300)
    with tarfile.open(next(work.glob("horovod-*.tar.gz"))) as archive:
        members = [m for m in archive.getmembers() if "/cmake/" in m.name]
        archive.extractall(work, members=members, filter="data")
    return work / f"horovod-{HOROVOD_VERSION}" / "cmake"


def configure_horovod_cuda(modules: Path, work: Path, env: dict[str, str]) -> str:
    """CMake's output for Horovod's CUDA and NCCL steps, run with `env` over a clean environment."""
    project = work / "project"
    project.mkdir(exist_ok=True)
    (project / "CMakeLists.txt").write_text(HOROVOD_CUDA_PROBE.format(modules=modules))
    build = Path(tempfile.mkdtemp(prefix="build-", dir=work))
    cmake = shutil.which("cmake", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    plain = {k: v for k, v in os.environ.items()
             if k not in (*cuda.TOOLKIT_VARIABLES, "CUDACXX", "CUDAToolkit_ROOT") and not k.startswith("HOROVOD_")}
    proc = subprocess.run([cmake, str(project)], cwd=build, capture_output=True, text=True, env={**plain, **env},
                          timeout=600)
    return proc.stdout + proc.stderr


def test_horovods_cmake_finds_the_toolkit_behind_a_wrapper_and_pips_nccl_once_told(tmp_path, horovod_cmake_modules):
    """The failure users met: with nvcc on PATH being a wrapper script, Horovod's vendored FindCUDAToolkit
    takes the wrapper's folder for the toolkit; GpuBuild.environment() points it at the real one."""
    toolkit = system_toolkit()
    wrapper_bin = tmp_path / "wrapper-bin"
    wrapper_bin.mkdir()
    (wrapper_bin / "nvcc").write_text(f'#!/bin/sh\nexec {toolkit.nvcc.resolve()} "$@"\n')
    (wrapper_bin / "nvcc").chmod(0o755)
    site = tmp_path / "site-packages"  # pip's NCCL wheel: nccl.h and libnccl.so.2 only
    (site / "nvidia/nccl/include").mkdir(parents=True)
    (site / "nvidia/nccl/lib").mkdir(parents=True)
    (site / "nvidia/nccl/include/nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 29\n#define NCCL_PATCH 7\n")
    (site / "nvidia/nccl/lib/libnccl.so.2").write_text("")
    path = f"{wrapper_bin}{os.pathsep}/usr/bin{os.pathsep}/bin"

    without = configure_horovod_cuda(horovod_cmake_modules, tmp_path,
                                     {"PATH": path, "HOROVOD_NCCL_HOME": str(site / "nvidia/nccl")})
    assert "Could NOT find CUDAToolkit" in without  # the bug, reproduced

    gpu = cuda.find_gpu_build(toolkit.version, {"PATH": path}, sites=[site])
    assert gpu.toolkit.root == toolkit.root.resolve() and gpu.toolkit.found_by == f"{wrapper_bin / 'nvcc'} on PATH"
    told = configure_horovod_cuda(horovod_cmake_modules, tmp_path,
                                  {"PATH": path, **gpu.environment(tmp_path / "cache")})
    assert "Found CUDAToolkit" in told and "Could NOT" not in told, told[-3000:]
    assert f"library: {tmp_path / 'cache'}/nccl-homes/nccl2.29.7-" in told


KERNEL = """\
#include <cuda_runtime.h>
__global__ void scale(float* x, float a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }
int main() { float* d; cudaMalloc(&d, 16); scale<<<1, 4>>>(d, 2.f, 4); return cudaFree(d); }
"""


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_pips_cuda_compiler_wheels_are_a_toolkit_for_nvcc_and_horovods_cmake(cuda_venv, tmp_path,
                                                                             horovod_cmake_modules):
    """No system toolkit at all: nvcc, its crt, nvvm and cccl from pip beside torch's runtime and NCCL."""
    python = str(cuda_venv / "bin" / "python")
    torch_cuda = subprocess.run([python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True,
                                text=True, check=True).stdout.strip()
    major = torch_cuda.split(".")[0]
    marker = cuda_venv / f".hvdgen-pip-nvcc-{major}"
    if not marker.exists():  # ~150 MB, once per cached venv
        subprocess.run([python, "-m", "pip", "install", "--quiet",
                        *(f"{name}=={torch_cuda}.*" for name in cuda.PIP_CUDA_COMPILER)], check=True, timeout=1800)
        marker.write_text("")
    cache = tmp_path / "cache"
    clean_path = f"{cuda_venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    found = subprocess.run([python, "-c", f"""
import json
from pathlib import Path
from hvdgen.build import cuda
toolkit = cuda.find_toolkit({torch_cuda!r}, {{"PATH": {clean_path!r}}}, cuda.site_dirs(), default_roots=())
gpu = cuda.GpuBuild(toolkit, cuda.find_nccl({{}}, cuda.site_dirs(), toolkit))
print(json.dumps({{"found_by": toolkit.found_by, "env": gpu.environment(Path({str(cache)!r}))}}))
"""], capture_output=True, text=True, env=hvdgen_env(cuda_venv), check=True)
    result = json.loads(found.stdout)
    assert result["found_by"] == "pip's nvidia wheels"
    env = result["env"]
    assert Path(env["CUDA_HOME"]).parent == cache / "cuda-homes"

    (tmp_path / "k.cu").write_text(KERNEL)
    compiled = subprocess.run([env["CUDACXX"], "-o", str(tmp_path / "k"), str(tmp_path / "k.cu")],
                              capture_output=True, text=True, env={**os.environ, "PATH": clean_path}, timeout=600)
    assert compiled.returncode == 0 and (tmp_path / "k").exists(), compiled.stderr[-3000:]

    told = configure_horovod_cuda(horovod_cmake_modules, tmp_path, {"PATH": clean_path, **env})
    assert f"Found CUDAToolkit: {env['CUDA_HOME']}" in told and "Could NOT" not in told, told[-3000:]
    assert "Found NCCL" in told


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


def test_cuda_arch_is_checked_against_what_the_toolkits_nvcc_compiles_for():
    toolkit = system_toolkit()
    from hvdgen.errors import HvdgenError
    from hvdgen.build.horovod_wheel import parse_cuda_arch

    supported = cuda.compute_capabilities(toolkit.nvcc)
    assert 90 in supported and 80 in supported, supported
    assert parse_cuda_arch("9.0,80", supported, toolkit.version) == (80, 90)
    for bad in ("95", "sm_90", ","):
        with pytest.raises(HvdgenError) as info:
            parse_cuda_arch(bad, supported, toolkit.version)
        assert info.value.message.startswith(f"--cuda-arch {bad}: CUDA {toolkit.version}'s nvcc compiles for 75, 80")
        assert "\n" not in info.value.message
