"""Finding the CUDA toolkit and NCCL for a Horovod GPU build, against real folder layouts in tmp_path.

The layouts are the ones users have: a toolkit named by CUDA_HOME, an nvcc on PATH that is a
symlink or a wrapper script, /usr/local/cuda, and pip's nvidia wheels (nvidia/cu13 with only
libcudart.so.13, nvidia/nccl with only libnccl.so.2). Where a test needs nvcc's own answer it uses
the real nvcc of this machine's toolkit and is skipped without one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hvdgen.build import cuda
from hvdgen.build.cuda import GpuBuild, GpuBuildBlocked, find_nccl, find_toolkit, nvcc_toolkit_root

REAL_TOOLKIT = next((r for r in cuda.DEFAULT_TOOLKIT_ROOTS if cuda.toolkit_at(r, str(r))), None)
needs_real_nvcc = pytest.mark.skipif(REAL_TOOLKIT is None, reason="Requires: a CUDA toolkit in /usr/local/cuda")


def _write(path: Path, text: str = "", executable: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if executable:
        path.chmod(0o755)
    return path


def make_toolkit(root: Path, version: int = 13000, cudart: str = "libcudart.so", lib: str = "lib64") -> Path:
    """A toolkit layout: bin/nvcc, include/cuda_runtime_api.h defining CUDART_VERSION, lib64/libcudart*."""
    _write(root / "bin" / "nvcc", "#!/bin/sh\nexit 0\n", executable=True)
    _write(root / "include" / "cuda_runtime_api.h", f"#pragma once\n#define CUDART_VERSION  {version}\n")
    _write(root / lib / cudart, "not really ELF")
    return root


def make_nccl(root: Path, library: str = "lib/libnccl.so.2", version: tuple[int, int, int] = (2, 29, 7)) -> Path:
    major, minor, patch = version
    _write(root / "include" / "nccl.h",
           f"#define NCCL_MAJOR {major}\n#define NCCL_MINOR {minor}\n#define NCCL_PATCH {patch}\n")
    _write(root / library, "not really ELF")
    return root


def no_defaults(tmp_path: Path) -> list[Path]:
    return [tmp_path / "no-usr-local-cuda"]


def test_a_complete_toolkit_is_recognised_and_an_incomplete_one_is_not(tmp_path):
    toolkit = cuda.toolkit_at(make_toolkit(tmp_path / "cuda-13.0"), "here")
    assert (toolkit.version, toolkit.cudart.name) == ("13.0", "libcudart.so")
    assert toolkit.nvcc == tmp_path / "cuda-13.0" / "bin" / "nvcc"
    make_toolkit(tmp_path / "no-cudart")
    (tmp_path / "no-cudart" / "lib64" / "libcudart.so").unlink()
    assert cuda.toolkit_at(tmp_path / "no-cudart", "here") is None
    make_toolkit(tmp_path / "no-nvcc")
    (tmp_path / "no-nvcc" / "bin" / "nvcc").unlink()
    assert cuda.toolkit_at(tmp_path / "no-nvcc", "here") is None


def test_cuda_home_wins_over_nvcc_on_path(tmp_path):
    named = make_toolkit(tmp_path / "named")
    on_path = make_toolkit(tmp_path / "on-path")
    env = {"CUDA_HOME": str(named), "PATH": str(on_path / "bin")}
    toolkit = find_toolkit("13.0", env, default_roots=no_defaults(tmp_path))
    assert (toolkit.root, toolkit.found_by) == (named, "CUDA_HOME")


@pytest.mark.parametrize("variable", ["CUDA_HOME", "CUDA_PATH", "HOROVOD_CUDA_HOME"])
def test_a_variable_that_points_nowhere_is_reported_not_routed_around(tmp_path, variable):
    on_path = make_toolkit(tmp_path / "on-path")
    env = {variable: str(tmp_path / "nowhere"), "PATH": str(on_path / "bin")}
    with pytest.raises(GpuBuildBlocked) as info:
        find_toolkit("13.0", env, default_roots=no_defaults(tmp_path))
    assert f"{variable}={tmp_path / 'nowhere'} is not a CUDA toolkit" in info.value.missing
    assert "install the CUDA 13 toolkit" in info.value.install


def test_nvcc_on_path_through_a_symlink_finds_the_real_toolkit(tmp_path):
    real = make_toolkit(tmp_path / "opt" / "cuda-13.0")
    bin_dir = tmp_path / "usr-local-bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").symlink_to(real / "bin" / "nvcc")
    toolkit = find_toolkit("13.0", {"PATH": str(bin_dir)}, default_roots=no_defaults(tmp_path))
    assert toolkit.root == real
    assert toolkit.found_by == f"{bin_dir / 'nvcc'} on PATH"


@needs_real_nvcc
def test_nvcc_on_path_through_a_wrapper_script_asks_nvcc_where_it_lives(tmp_path):
    """The set-up of this machine: /usr/local/bin/nvcc is `exec /usr/local/cuda-13.0/bin/nvcc "$@"`."""
    real_root = REAL_TOOLKIT.resolve()
    wrapper = _write(tmp_path / "bin" / "nvcc", f'#!/bin/sh\nexec {real_root}/bin/nvcc "$@"\n', executable=True)
    assert nvcc_toolkit_root(wrapper) == real_root
    toolkit = find_toolkit(cuda.cuda_headers_version(real_root / "include"), {"PATH": str(wrapper.parent)},
                           default_roots=no_defaults(tmp_path))
    assert toolkit.root == real_root


def test_the_toolkit_matching_torchs_major_version_is_chosen(tmp_path):
    old = make_toolkit(tmp_path / "cuda-12.4", version=12040)
    new = make_toolkit(tmp_path / "cuda-13.0", version=13000)
    toolkit = find_toolkit("13.0", {"PATH": str(old / "bin")}, default_roots=[new])
    assert (toolkit.root, toolkit.version) == (new, "13.0")
    with pytest.raises(GpuBuildBlocked) as info:
        find_toolkit("13.0", {"PATH": str(old / "bin")}, default_roots=no_defaults(tmp_path))
    assert f"the only toolkits here are CUDA 12.4 at {old}" in info.value.missing


def test_no_toolkit_anywhere_names_every_place_looked(tmp_path):
    with pytest.raises(GpuBuildBlocked) as info:
        find_toolkit("13.0", {"PATH": str(tmp_path)}, sites=[tmp_path / "site"], default_roots=no_defaults(tmp_path))
    message = str(info.value)
    assert "torch was built for CUDA 13.0 but no CUDA compiler was found" in message
    assert all(place in message for place in ("CUDA_HOME", "nvcc on PATH", "/usr/local/cuda"))
    assert "\n" not in message
    assert info.value.install == ("install the CUDA 13 toolkit (nvcc) and set CUDA_HOME to it, or pip install "
                                  "nvidia-cuda-nvcc==13.0.* nvidia-cuda-crt==13.0.* nvidia-nvvm==13.0.* "
                                  "nvidia-cuda-cccl==13.0.*")
    with pytest.raises(GpuBuildBlocked) as info:  # CUDA 12's wheels have another layout: only the toolkit
        find_toolkit("12.8", {"PATH": str(tmp_path)}, default_roots=no_defaults(tmp_path))
    assert info.value.install == "install the CUDA 12 toolkit (nvcc) and set CUDA_HOME to it"


def test_pips_cuda_wheels_with_nvcc_get_a_toolkit_layout_in_the_cache(tmp_path):
    """pip's nvidia/cu13 has libcudart.so.13 only (CMake's FindCUDAToolkit wants libcudart.so) and no
    targets/<arch>/ folders (nvcc.profile points there, relative to where the nvcc binary lies)."""
    site = tmp_path / "site-packages"
    pip_root = make_toolkit(site / "nvidia" / "cu13", cudart="libcudart.so.13", lib="lib")
    _write(pip_root / "bin" / "nvcc.profile", "TOP = $(_HERE_)/..\n")
    _write(pip_root / "bin" / "ptxas", executable=True)
    _write(pip_root / "lib" / "libcublas.so.13")
    _write(pip_root / "nvvm" / "bin" / "cicc", executable=True)
    toolkit = find_toolkit("13.0", {"PATH": str(tmp_path / "empty")}, sites=[site],
                           default_roots=no_defaults(tmp_path))
    assert (toolkit.root, toolkit.found_by, toolkit.from_pip) == (pip_root, "pip's nvidia wheels", True)
    cache = tmp_path / "cache"
    home = toolkit.build_root(cache)
    assert home.parent == cache / "cuda-homes"
    assert (home / "lib" / "libcudart.so").resolve() == pip_root / "lib" / "libcudart.so.13"
    assert (home / "lib64" / "libcublas.so.13").resolve() == pip_root / "lib" / "libcublas.so.13"
    arch = f"targets/{cuda.TARGET_ARCH.get(cuda.platform.machine(), cuda.platform.machine())}-linux"
    assert (home / arch / "include" / "cuda_runtime_api.h").resolve() == pip_root / "include" / "cuda_runtime_api.h"
    assert (home / arch / "lib" / "libcudart.so").exists()
    for own in ("nvcc", "nvcc.profile"):  # real files, so nvcc's _HERE_ is the assembled bin/
        assert not (home / "bin" / own).is_symlink() and (home / "bin" / own).read_bytes() == \
            (pip_root / "bin" / own).read_bytes()
    assert (home / "bin" / "ptxas").resolve() == pip_root / "bin" / "ptxas"
    assert (home / "nvvm" / "bin" / "cicc").resolve() == pip_root / "nvvm" / "bin" / "cicc"
    assert cuda.toolkit_at(home, "assembled").cudart.name == "libcudart.so"
    assert toolkit.build_root(cache) == home
    assert [p.name for p in (cache / "cuda-homes").iterdir()] == [home.name]  # no staging left behind


def test_a_complete_toolkit_is_used_where_it_is(tmp_path):
    toolkit = cuda.toolkit_at(make_toolkit(tmp_path / "cuda"), "here")
    assert toolkit.build_root(tmp_path / "cache") == tmp_path / "cuda"
    assert not (tmp_path / "cache").exists()


def test_pips_nccl_wheel_gets_a_home_with_the_unversioned_library(tmp_path):
    site = tmp_path / "site-packages"
    pip_nccl = make_nccl(site / "nvidia" / "nccl")
    system = make_nccl(tmp_path / "usr", library="lib/libnccl.so", version=(2, 18, 1))
    nccl = find_nccl({}, sites=[site], system_roots=[system])
    assert (nccl.version, nccl.found_by, nccl.library.name) == ("2.29.7", "pip's nvidia-nccl wheel", "libnccl.so.2")
    cache = tmp_path / "cache"
    env = nccl.build_env(cache)
    home = Path(env["HOROVOD_NCCL_HOME"])
    assert home.parent == cache / "nccl-homes" and home.name.startswith("nccl2.29.7-")
    assert (home / "lib" / "libnccl.so").resolve() == pip_nccl / "lib" / "libnccl.so.2"
    assert (home / "include" / "nccl.h").resolve() == pip_nccl / "include" / "nccl.h"
    assert env["HOROVOD_NCCL_INCLUDE"] == str(home / "include") and env["HOROVOD_NCCL_LIB"] == str(home / "lib")
    assert env["HOROVOD_NCCL_LINK"] == "SHARED"
    # TensorFlow does not load pip's NCCL before Horovod's library: the library finds it beside itself
    assert env["LDFLAGS"] == "-Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib"


def test_another_venvs_nccl_gets_its_own_home(tmp_path):
    cache = tmp_path / "cache"
    first = find_nccl({}, sites=[tmp_path / "a"], system_roots=[make_nccl(tmp_path / "a" / "nvidia" / "nccl")])
    second = find_nccl({}, sites=[tmp_path / "b"], system_roots=[make_nccl(tmp_path / "b" / "nvidia" / "nccl")])
    assert first.build_env(cache)["HOROVOD_NCCL_HOME"] != second.build_env(cache)["HOROVOD_NCCL_HOME"]


def test_nccl_from_the_toolkit_then_the_system_with_debians_multiarch_folder(tmp_path):
    toolkit = cuda.toolkit_at(make_nccl(make_toolkit(tmp_path / "cuda"), library="lib64/libnccl.so"), "here")
    nccl = find_nccl({}, sites=[tmp_path / "site"], toolkit=toolkit, system_roots=[tmp_path / "usr"])
    assert nccl.found_by == f"the CUDA toolkit at {tmp_path / 'cuda'}"
    env = nccl.build_env(tmp_path / "cache")
    assert env["HOROVOD_NCCL_LIB"] == str(tmp_path / "cuda" / "lib64") and not (tmp_path / "cache").exists()
    assert "LDFLAGS" not in env  # CMake's build RUNPATH already names the toolkit's folder
    multiarch = cuda.sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        system = make_nccl(tmp_path / "usr", library=f"lib/{multiarch}/libnccl.so", version=(2, 21, 5))
        nccl = find_nccl({}, sites=[tmp_path / "site"], system_roots=[system])
        assert (nccl.version, nccl.library) == ("2.21.5", system / "lib" / multiarch / "libnccl.so")


def test_nccl_named_by_horovods_variables_is_used_or_reported(tmp_path):
    home = make_nccl(tmp_path / "my-nccl", library="lib/libnccl.so")
    nccl = find_nccl({"HOROVOD_NCCL_HOME": str(home)}, sites=[])
    assert (nccl.found_by, nccl.library) == (f"HOROVOD_NCCL_HOME={home}", home / "lib" / "libnccl.so")
    split = find_nccl({"HOROVOD_NCCL_INCLUDE": str(home / "include"), "HOROVOD_NCCL_LIB": str(home / "lib")}, sites=[])
    assert split.library == home / "lib" / "libnccl.so"
    with pytest.raises(GpuBuildBlocked, match=f"HOROVOD_NCCL_HOME={tmp_path / 'empty'} has no nccl.h"):
        find_nccl({"HOROVOD_NCCL_HOME": str(tmp_path / "empty")}, sites=[make_nccl(tmp_path / "site")])


def test_no_nccl_anywhere_says_how_to_get_it(tmp_path):
    toolkit = cuda.toolkit_at(make_toolkit(tmp_path / "cuda", version=12080), "here")
    with pytest.raises(GpuBuildBlocked) as info:
        find_nccl({}, sites=[tmp_path / "site"], toolkit=toolkit, system_roots=[tmp_path / "usr"])
    assert "no NCCL was found" in info.value.missing
    assert info.value.install.startswith("pip install nvidia-nccl-cu12")


def test_gpu_build_environment_points_horovods_cmake_at_the_toolkit_and_nccl(tmp_path):
    site = tmp_path / "site-packages"
    make_nccl(site / "nvidia" / "nccl")
    toolkit_root = make_toolkit(tmp_path / "cuda-13.0")
    gpu = cuda.find_gpu_build("13.0", {"CUDA_PATH": str(toolkit_root)}, sites=[site])
    env = gpu.environment(tmp_path / "cache")
    assert env["CUDA_HOME"] == env["HOROVOD_CUDA_HOME"] == env["CUDAToolkit_ROOT"] == str(toolkit_root)
    assert env["CUDACXX"] == str(toolkit_root / "bin" / "nvcc") and env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert Path(env["HOROVOD_NCCL_HOME"]).is_relative_to(tmp_path / "cache")
    assert isinstance(gpu, GpuBuild)


def test_the_real_toolkit_of_this_machine_is_found_from_the_default_place(tmp_path):
    if REAL_TOOLKIT is None:
        pytest.skip("Requires: a CUDA toolkit in /usr/local/cuda")
    version = cuda.cuda_headers_version(REAL_TOOLKIT / "include")
    path_without_nvcc = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                                        if not shutil.which("nvcc", path=d))
    toolkit = find_toolkit(version, {"PATH": path_without_nvcc})
    assert toolkit.root == REAL_TOOLKIT and os.access(toolkit.nvcc, os.X_OK)
