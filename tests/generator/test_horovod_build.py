"""`hvdgen install-horovod` and `hvdgen doctor` against the real sdist and the installed build."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hvdgen.build import horovod_wheel
from hvdgen.build.checks import parse_check_build
from hvdgen.errors import HvdgenError
from hvdgen.build.patches import patches_digest

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def sdist_source(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "-d", str(work), f"horovod=={horovod_wheel.HOROVOD_VERSION}"], check=True)
    with tarfile.open(next(work.glob("horovod-*.tar.gz"))) as archive:
        archive.extractall(work, filter="data")
    return work / f"horovod-{horovod_wheel.HOROVOD_VERSION}"


def test_patches_apply_to_the_real_sdist(sdist_source):
    horovod_wheel.apply_patches(sdist_source)
    assert "set(CMAKE_CXX_STANDARD 17)" in (sdist_source / "CMakeLists.txt").read_text()
    assert "CMAKE_CXX_STANDARD 14" not in (sdist_source / "horovod/torch/CMakeLists.txt").read_text()
    assert "xla_mpi_ops.cc" not in (sdist_source / "horovod/tensorflow/CMakeLists.txt").read_text()
    with pytest.raises(HvdgenError, match="sdist changed"):
        horovod_wheel.apply_patches(sdist_source)  # already patched: the old text is gone


def test_cache_key_names_every_version():
    target = horovod_wheel.BuildTarget(python="311", torch="2.13.0+cpu", tensorflow=None, mpi=True)
    assert target.key == f"horovod0.28.1-p{patches_digest()}_py311_torch2.13.0+cpu_tf-none_gloo_mpi"
    assert target.frameworks == ["PyTorch"]


def test_cache_key_names_cuda_and_nccl_and_sets_a_cpu_only_build_apart():
    gpu = horovod_wheel.BuildTarget(python="312", torch="2.13.0", tensorflow="2.21.0", mpi=False,
                                    cuda="13.0", nccl="2.29.7", patches="abcd1234")
    assert gpu.key == "horovod0.28.1-pabcd1234_py312_torch2.13.0_tf2.21.0_gloo_cuda13.0_nccl2.29.7"
    cpu_only = horovod_wheel.BuildTarget(python="312", torch="2.13.0", tensorflow="2.21.0", mpi=False,
                                         cpu_only=True, patches="abcd1234")
    assert cpu_only.key == "horovod0.28.1-pabcd1234_py312_torch2.13.0_tf2.21.0_gloo_cpu-only"
    other_patches = horovod_wheel.BuildTarget(python="312", torch="2.13.0", tensorflow="2.21.0", mpi=False,
                                              cpu_only=True, patches="00000000")
    assert other_patches.key != cpu_only.key


def test_build_environment_selects_frameworks_and_controllers(monkeypatch):
    monkeypatch.setenv("HOROVOD_GPU_OPERATIONS", "NCCL")  # a stray user setting must not turn a CPU build into NCCL
    target = horovod_wheel.BuildTarget(python="311", torch="2.13.0", tensorflow=None, mpi=False)
    env = horovod_wheel.build_environment(target, jobs=3)
    assert env["HOROVOD_WITH_PYTORCH"] == env["HOROVOD_WITHOUT_TENSORFLOW"] == env["HOROVOD_WITHOUT_MPI"] == "1"
    assert env["MAKEFLAGS"] == "-j3"
    assert all(f"-include {h}" in env["CXXFLAGS"] for h in ("cstdint", "string", "stdexcept"))
    assert "HOROVOD_GPU_OPERATIONS" not in env


def test_cuda_arch_narrows_the_kernels_and_a_stray_variable_does_not(monkeypatch):
    monkeypatch.setenv("HOROVOD_BUILD_CUDA_CC_LIST", "75")  # the key would say every GPU; the wheel would not
    gpu = dict(python="312", torch="2.13.0", tensorflow=None, mpi=False, cuda="13.0", nccl="2.29.7")
    every = horovod_wheel.BuildTarget(**gpu)
    assert "HOROVOD_BUILD_CUDA_CC_LIST" not in horovod_wheel.build_environment(every, jobs=1)
    narrow = horovod_wheel.BuildTarget(**gpu, cuda_arch=(80, 90))
    assert horovod_wheel.build_environment(narrow, jobs=1)["HOROVOD_BUILD_CUDA_CC_LIST"] == "80,90"
    assert narrow.key == every.key + "_sm80-90"


def test_tensorflow_beside_a_cuda_torch_is_refused_before_the_build_unless_cpu_only(monkeypatch):
    versions = {"torch": "2.13.0", "tensorflow": "2.21.0"}
    monkeypatch.setattr(horovod_wheel, "_dist_version", versions.get)
    monkeypatch.setattr(horovod_wheel, "torch_cuda_version", lambda: "13.0")
    with pytest.raises(HvdgenError) as info:
        horovod_wheel.detect_target()
    message = info.value.message
    assert "TensorFlow 2.21.0 is installed beside a CUDA build of torch" in message and "\n" not in message
    assert message.endswith("or build without GPU ops: hvdgen install-horovod --cpu-only")
    target, gpu = horovod_wheel.detect_target(cpu_only=True)
    assert gpu is None and target.cpu_only and "_tf2.21.0_gloo" in target.key and target.key.endswith("_cpu-only")


def test_gpu_linker_flags_follow_the_users_own(monkeypatch):
    monkeypatch.setenv("LDFLAGS", "-L/opt/mine")
    target = horovod_wheel.BuildTarget(python="312", torch="2.13.0", tensorflow=None, mpi=False, cuda="13.0",
                                       nccl="2.29.7")
    env = horovod_wheel.build_environment(target, jobs=1, gpu_env={"LDFLAGS": "-Wl,-rpath,$ORIGIN/x",
                                                                   "HOROVOD_GPU_OPERATIONS": "NCCL"})
    assert env["LDFLAGS"] == "-L/opt/mine -Wl,-rpath,$ORIGIN/x" and env["HOROVOD_GPU_OPERATIONS"] == "NCCL"


def test_failure_explains_the_likely_fix(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("compiling\n" * 50 + "fatal error: highwayhash/arch_specific.h: No such file or directory\n")
    message = horovod_wheel.explain_failure(log)
    assert "libhighwayhash-dev" in message and str(log) in message
    assert message.count("compiling") == 39  # the tail, not the whole log


def test_an_offline_build_without_cffi_says_to_install_it(tmp_path):
    """What an offline GPU machine printed: Horovod's setup_requires cffi, and no index answered."""
    log = tmp_path / "build.log"
    log.write_text("  ERROR: Could not find a version that satisfies the requirement cffi>=1.4.0 (from versions: none)\n"
                   "  ERROR: No matching distribution found for cffi>=1.4.0\n")
    message = horovod_wheel.explain_failure(log)
    assert "likely fix: Horovod's setup.py needs cffi" in message and "pip install cffi" in message


@pytest.mark.slow
def test_second_install_reuses_the_installed_wheel():
    proc = subprocess.run([str(BIN / "hvdgen"), "install-horovod"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "is installed from the cached wheel" in proc.stdout


def test_doctor_reports_the_build():
    proc = subprocess.run([str(BIN / "hvdgen"), "doctor"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    frameworks = next(line for line in proc.stdout.splitlines() if line.strip().startswith("frameworks"))
    controllers = next(line for line in proc.stdout.splitlines() if line.strip().startswith("controllers"))
    assert "PyTorch" in frameworks and "Gloo" in controllers
    # install-horovod builds MPI in exactly when OpenMPI's compiler is there (scripts/setup.sh installs it)
    assert ("MPI" in controllers) == (shutil.which("mpicxx") is not None), controllers
    tensor_ops = next(line for line in proc.stdout.splitlines() if line.strip().startswith("tensor ops"))
    assert "Gloo" in tensor_ops and "NCCL" not in tensor_ops  # this venv's torch is a CPU build
    assert "(CPU build)" in proc.stdout and "warning" not in proc.stderr


def test_doctor_fails_without_horovod_and_says_what_to_do(tmp_path):
    """A fresh environment that has hvdgen (and click) but no framework and no Horovod."""
    import click

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    only_click = tmp_path / "site"
    only_click.mkdir()
    (only_click / "click").symlink_to(Path(click.__file__).parent)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PATH="/usr/bin:/bin", PYTHONPATH=f"{repo}{os.pathsep}{only_click}")
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-m", "hvdgen", "doctor"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "horovod is missing: run hvdgen install-horovod" in proc.stderr
    assert "no framework installed" in proc.stderr


def test_parse_check_build_reads_horovodrun_output():
    out = subprocess.run([str(BIN / "horovodrun"), "--check-build"], capture_output=True, text=True).stdout
    build = parse_check_build(out)
    assert build["Frameworks"]["PyTorch"] is True
    assert build["Controllers"]["Gloo"] is True
    assert set(build) == {"Frameworks", "Controllers", "Tensor Operations"}


def test_a_wheel_built_for_both_frameworks_serves_either_alone(tmp_path, monkeypatch):
    """A project's torch-only venv reuses its developer's torch+TF build: same Python, same torch
    version, same controllers and patches; a different torch version or controller set does not."""
    from hvdgen.build.horovod_wheel import BuildTarget, cached_wheel, wheel_cache_dir

    monkeypatch.setenv("HVDGEN_CACHE_DIR", str(tmp_path))
    both = BuildTarget(python="311", torch="2.13.0+cpu", tensorflow="2.21.0", mpi=False)
    folder = wheel_cache_dir(both)
    folder.mkdir(parents=True)
    wheel = folder / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"wheel")
    assert cached_wheel(BuildTarget(python="311", torch="2.13.0+cpu", tensorflow=None, mpi=False)) == wheel
    assert cached_wheel(BuildTarget(python="311", torch=None, tensorflow="2.21.0", mpi=False)) == wheel
    assert cached_wheel(BuildTarget(python="311", torch="2.12.0+cpu", tensorflow=None, mpi=False)) is None
    assert cached_wheel(BuildTarget(python="311", torch="2.13.0+cpu", tensorflow=None, mpi=True)) is None
    assert cached_wheel(BuildTarget(python="312", torch="2.13.0+cpu", tensorflow=None, mpi=False)) is None


@pytest.mark.parametrize("how", ["option", "environment"])
def test_cuda_arch_on_a_cpu_torch_is_refused_in_one_line_leaving_horovod_alone(tmp_path, how):
    from hvdgen.build.cuda import torch_cuda_version

    if torch_cuda_version() is not None:
        pytest.skip("Requires: a CPU build of torch in this environment")
    before = horovod_wheel.installed_wheel_url()
    args, extra = (["--cuda-arch", "90"], {}) if how == "option" else ([], {"HVDGEN_CUDA_ARCH": "90"})
    proc = subprocess.run([str(BIN / "hvdgen"), "install-horovod", *args], capture_output=True, text=True,
                          env=dict(os.environ, HVDGEN_CACHE_DIR=str(tmp_path / "cache"), **extra), timeout=120)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0 and len(lines) == 1, lines
    assert ("--cuda-arch 90 selects GPUs for Horovod's CUDA kernels, but this build has none (torch is a CPU build): "
            "drop --cuda-arch") in lines[0]
    assert not (tmp_path / "cache").exists()
    assert horovod_wheel.installed_wheel_url() == before


def test_a_relative_cache_dir_finds_the_installed_wheel(tmp_path):
    """HVDGEN_CACHE_DIR=.gpu/cache, relative to where the command runs (seen on a GPU machine: a
    crash, since pip records a wheel by file:// URL and a relative path has none). The cache the
    installed wheel came from, named relative to another folder, answers without a reinstall."""
    from hvdgen.paths import cache_dir

    installed = horovod_wheel.installed_wheel_url()
    if not (installed or "").startswith(cache_dir().as_uri() + "/"):
        pytest.skip(f"Requires: horovod installed from hvdgen's cache {cache_dir()} (it is from {installed})")
    relative = os.path.relpath(cache_dir(), tmp_path)
    proc = subprocess.run([str(BIN / "hvdgen"), "install-horovod"], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ, HVDGEN_CACHE_DIR=relative), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "is installed from the cached wheel" in proc.stdout
    assert horovod_wheel.installed_wheel_url() == installed
