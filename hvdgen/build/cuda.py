"""Find the CUDA compiler and NCCL a Horovod GPU build needs, where users actually have them.

A CUDA build of torch from pip brings its CUDA runtime and NCCL as pip wheels (`nvidia/cu13`,
`nvidia/nccl` in site-packages) but no compiler, and no unversioned `libnccl.so` for a linker to
find. The compiler is wherever the user put a toolkit: named by `CUDA_HOME`/`CUDA_PATH`, reached
through an `nvcc` on PATH that may be a symlink or a wrapper script, or in `/usr/local/cuda`.
Horovod's CMake finds none of this on its own (it takes the folder above a wrapper's `bin/` for the
toolkit and stops with "Could NOT find CUDAToolkit"), so this module finds it and says so
explicitly. Where a library exists only under its versioned name, it assembles a small folder of
symlinks under hvdgen's cache (atomically, so two builds never see half of one).

Nothing here decides policy: a lookup that fails raises `GpuBuildBlocked` naming what is missing
and how to install it; the build command turns that into its one-line refusal.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# Where a toolkit is looked for when nothing names one: the installers' default symlink.
DEFAULT_TOOLKIT_ROOTS = (Path("/usr/local/cuda"),)
# Variables a user sets to name a toolkit, in the order they win. HOROVOD_CUDA_HOME is Horovod's own.
TOOLKIT_VARIABLES = ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")
# Library folders inside a toolkit, NCCL home or pip wheel, in the order CUDA's own layouts use them.
LIB_SUBDIRS = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
# pip's NCCL as seen from Horovod's libraries: both lie in site-packages, at horovod/<framework>/ and nvidia/nccl/lib.
PIP_NCCL_RUNPATH = "$ORIGIN/../../nvidia/nccl/lib"
# nvcc's name for the machine in targets/<name>-linux.
TARGET_ARCH = {"x86_64": "x86_64", "aarch64": "sbsa"}
# pip's wheels that make a CUDA 13+ compiler beside torch's runtime, in nvidia/cuNN (checked to build Horovod).
PIP_CUDA_COMPILER = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl")
# nvcc finds its profile, and the profile finds the toolkit, from where the nvcc binary really lies.
NVCC_OWN_FILES = ("nvcc", "nvcc.profile")


class GpuBuildBlocked(Exception):
    """A GPU build cannot go ahead: `missing` says what is absent, `install` how to get it."""

    def __init__(self, missing: str, install: str):
        super().__init__(f"{missing}: {install}")
        self.missing = missing
        self.install = install


@dataclass(frozen=True)
class CudaToolkit:
    """A CUDA toolkit to compile with: bin/nvcc, the runtime headers, and libcudart."""

    root: Path
    version: str  # "13.0", from the runtime headers
    cudart: Path  # libcudart.so, or only libcudart.so.N in pip's wheels
    found_by: str  # where the search found it, for messages and `hvdgen doctor`

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"

    @property
    def from_pip(self) -> bool:
        """pip's nvidia/cuNN: nvcc, headers and libraries side by side, without a toolkit's layout."""
        return self.root.parent.name == "nvidia" and re.fullmatch(r"cu\d+", self.root.name) is not None

    def build_root(self, cache: Path) -> Path:
        """A root that nvcc and CMake's FindCUDAToolkit both accept: an installed toolkit as it is;
        for pip's wheels, a toolkit layout assembled in the cache.

        pip's nvidia/cuNN lacks the unversioned libcudart.so that FindCUDAToolkit asks for and the
        targets/<arch>/{include,lib} folders that nvcc.profile points at (relative to where the nvcc
        binary really is, so nvcc itself and its profile are copied; everything else is linked).
        """
        if not self.from_pip:
            return self.root
        arch = f"targets/{TARGET_ARCH.get(platform.machine(), platform.machine())}-linux"
        links: dict[str, Path] = {entry.name: entry for entry in self.root.iterdir()
                                  if entry.name not in ("bin", *LIB_SUBDIRS)}
        links.update({f"bin/{entry.name}": entry for entry in (self.root / "bin").iterdir()
                      if entry.name not in NVCC_OWN_FILES})
        links.update({f"lib/{lib.name}": lib for lib in self.cudart.parent.iterdir()})
        links.update({"lib/libcudart.so": self.cudart, "lib64": Path("lib"),
                      f"{arch}/include": Path("../../include"), f"{arch}/lib": Path("../../lib")})
        copies = {f"bin/{name}": self.root / "bin" / name for name in NVCC_OWN_FILES}
        return assembled_home(cache / "cuda-homes", f"cuda{self.version}", links, copies)


@dataclass(frozen=True)
class Nccl:
    """NCCL's header folder and shared library (libnccl.so, or only libnccl.so.N in pip's wheel)."""

    include: Path
    library: Path
    version: str  # "2.29.7", from nccl.h
    found_by: str
    runpath: str | None = None  # where Horovod's installed libraries find this NCCL, relative to themselves

    def build_env(self, cache: Path) -> dict[str, str]:
        """Horovod's HOROVOD_NCCL_* variables, assembling a home when only libnccl.so.N exists.

        Horovod's FindNCCL asks the linker for `libnccl.so`; pip's wheel has only `libnccl.so.2`.
        The assembled home links `include/` and `lib/libnccl.so` to pip's files. The built library
        needs libnccl.so.2 at run time: torch has loaded it from its wheel before horovod.torch
        loads, but TensorFlow has not, so pip's NCCL also goes on the libraries' RUNPATH, relative
        to where they are installed (LDFLAGS, which CMake reads at configure time).
        """
        if self.library.name == "libnccl.so":
            home, include, lib = self.include.parent, self.include, self.library.parent
        else:
            home = assembled_home(cache / "nccl-homes", f"nccl{self.version}",
                                  {"include": self.include, "lib/libnccl.so": self.library})
            include, lib = home / "include", home / "lib"
        env = {"HOROVOD_NCCL_HOME": str(home), "HOROVOD_NCCL_INCLUDE": str(include),
               "HOROVOD_NCCL_LIB": str(lib), "HOROVOD_NCCL_LINK": "SHARED"}
        if self.runpath:
            env["LDFLAGS"] = f"-Wl,-rpath,{self.runpath}"
        return env


def header_define(header: Path, name: str) -> int | None:
    """The integer a header #defines for `name`, or None (no compiler needed to read a version)."""
    try:
        text = header.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(rf"^\s*#\s*define\s+{name}\s+(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def cuda_headers_version(include: Path) -> str | None:
    """'13.0' from CUDART_VERSION 13000 in cuda_runtime_api.h."""
    code = header_define(include / "cuda_runtime_api.h", "CUDART_VERSION")
    return None if code is None else f"{code // 1000}.{code % 1000 // 10}"


def nccl_header_version(include: Path) -> str | None:
    """'2.29.7' from nccl.h's NCCL_MAJOR/MINOR/PATCH."""
    parts = [header_define(include / "nccl.h", f"NCCL_{part}") for part in ("MAJOR", "MINOR", "PATCH")]
    return None if None in parts else ".".join(map(str, parts))


def find_library(root: Path, stem: str) -> Path | None:
    """`<stem>.so` in one of root's library folders (Debian's multiarch one too), else the newest `<stem>.so.N`."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    subdirs = [*LIB_SUBDIRS, *([f"lib/{multiarch}"] if multiarch else [])]
    dirs = [root / sub for sub in subdirs if (root / sub).is_dir()]
    for lib in dirs:
        if (lib / f"{stem}.so").exists():
            return lib / f"{stem}.so"
    for lib in dirs:
        versioned = sorted(lib.glob(f"{stem}.so.[0-9]*"), key=lambda p: len(p.name))
        if versioned:
            return versioned[0]
    return None


def toolkit_at(root: Path, found_by: str) -> CudaToolkit | None:
    """The toolkit at `root` if it has an executable bin/nvcc, the runtime headers and libcudart."""
    version = cuda_headers_version(root / "include")
    cudart = find_library(root, "libcudart")
    if not (os.access(root / "bin" / "nvcc", os.X_OK) and version and cudart):
        return None
    return CudaToolkit(root=root, version=version, cudart=cudart, found_by=found_by)


def nvcc_toolkit_root(nvcc: Path) -> Path:
    """The toolkit an `nvcc` on PATH belongs to, through symlinks and wrapper scripts.

    A symlink resolves to the real bin/nvcc. A wrapper script (`exec /opt/cuda-13/bin/nvcc "$@"`,
    ccache, an environment-module shim) is asked: nvcc's dry run prints the folder it runs from.
    """
    real = nvcc.resolve()
    if (real.parent.parent / "include" / "cuda_runtime_api.h").is_file():
        return real.parent.parent
    try:
        probe = subprocess.run([str(nvcc), "--dryrun", "-v", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return real.parent.parent
    here = re.search(r"^#\$ _HERE_=(.+)$", probe.stdout + probe.stderr, re.MULTILINE)
    return Path(here.group(1).strip()).resolve().parent if here else real.parent.parent


def site_dirs() -> list[Path]:
    """This interpreter's site-packages folders, where pip puts the nvidia-* wheels."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(Path(paths[key]) for key in ("purelib", "platlib")))


def pip_cuda_roots(sites: Sequence[Path]) -> list[Path]:
    """nvidia/cuNN folders of pip's CUDA 13+ wheels (headers and libcudart; nvcc once nvidia-cuda-nvcc is in)."""
    return [p for site in sites for p in sorted((site / "nvidia").glob("cu[0-9]*"), reverse=True) if p.is_dir()]


def _major(version: str) -> str:
    return version.split(".")[0]


def find_toolkit(cuda_version: str, env: Mapping[str, str] = os.environ, sites: Sequence[Path] = (),
                 default_roots: Sequence[Path] = DEFAULT_TOOLKIT_ROOTS) -> CudaToolkit:
    """The toolkit to compile Horovod's GPU ops with, for a torch built against `cuda_version`.

    A variable the user set wins or fails loudly (a CUDA_HOME that points nowhere is a mistake to
    report, not to route around). Otherwise the first toolkit whose major version matches torch's:
    nvcc on PATH, pip's nvidia/cuNN (once nvidia-cuda-nvcc is installed), then /usr/local/cuda.
    """
    install = toolkit_install_hint(cuda_version)
    for name in TOOLKIT_VARIABLES:
        if env.get(name):
            root = Path(env[name])
            toolkit = toolkit_at(root, name)
            if toolkit is None:
                raise GpuBuildBlocked(f"{name}={root} is not a CUDA toolkit (it needs bin/nvcc, "
                                      "include/cuda_runtime_api.h and libcudart)", install)
            if _major(toolkit.version) != _major(cuda_version):
                raise GpuBuildBlocked(f"{name}={root} is CUDA {toolkit.version} but torch was built for "
                                      f"CUDA {cuda_version}", install)
            return toolkit
    others: list[CudaToolkit] = []
    for toolkit in _toolkit_candidates(env, sites, default_roots):
        if _major(toolkit.version) == _major(cuda_version):
            return toolkit
        others.append(toolkit)
    if others:
        listed = ", ".join(f"CUDA {t.version} at {t.root}" for t in others)
        raise GpuBuildBlocked(f"torch was built for CUDA {cuda_version} but the only toolkits here are {listed}",
                              install)
    raise GpuBuildBlocked(f"torch was built for CUDA {cuda_version} but no CUDA compiler was found "
                          "(CUDA_HOME, CUDA_PATH, nvcc on PATH, pip's nvidia wheels, /usr/local/cuda)", install)


def toolkit_install_hint(cuda_version: str) -> str:
    """How to get a compiler for torch's CUDA: the toolkit, or (CUDA 13 on) pip's compiler wheels."""
    hint = f"install the CUDA {_major(cuda_version)} toolkit (nvcc) and set CUDA_HOME to it"
    if _major(cuda_version).isdigit() and int(_major(cuda_version)) >= 13:
        hint += ", or pip install " + " ".join(f"{name}=={cuda_version}.*" for name in PIP_CUDA_COMPILER)
    return hint


def _toolkit_candidates(env: Mapping[str, str], sites: Sequence[Path],
                        default_roots: Sequence[Path]) -> Iterator[CudaToolkit]:
    nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    candidates = [(nvcc_toolkit_root(Path(nvcc)), f"{nvcc} on PATH")] if nvcc else []
    candidates += [(root, "pip's nvidia wheels") for root in pip_cuda_roots(sites)]
    candidates += [(root, str(root)) for root in default_roots]
    for root, found_by in candidates:
        toolkit = toolkit_at(root, found_by)
        if toolkit:
            yield toolkit


def find_nccl(env: Mapping[str, str] = os.environ, sites: Sequence[Path] = (),
              toolkit: CudaToolkit | None = None, system_roots: Sequence[Path] = (Path("/usr"),)) -> Nccl:
    """NCCL for the build: what the user named, else pip's (the one torch loads), the toolkit's, the system's."""
    install = f"pip install nvidia-nccl-cu{_major(toolkit.version) if toolkit else '13'} (or set HOROVOD_NCCL_HOME)"
    named = [(f"HOROVOD_NCCL_{key}", env.get(f"HOROVOD_NCCL_{key}")) for key in ("HOME", "INCLUDE", "LIB")]
    named = [(name, Path(value)) for name, value in named if value]
    if named:
        values = dict(named)
        home = values.get("HOROVOD_NCCL_HOME")
        include = values.get("HOROVOD_NCCL_INCLUDE") or (home / "include" if home else None)
        lib_root = values["HOROVOD_NCCL_LIB"].parent if "HOROVOD_NCCL_LIB" in values else home
        library = find_library(lib_root, "libnccl") if lib_root else None
        version = nccl_header_version(include) if include else None
        found_by = " and ".join(f"{name}={value}" for name, value in named)
        if not (library and version):
            raise GpuBuildBlocked(f"{found_by} has no nccl.h and libnccl",
                                  "point it at a folder with include/nccl.h and lib/libnccl.so, or unset it to use "
                                  "pip's nvidia-nccl wheel")
        return Nccl(include=include, library=library, version=version, found_by=found_by)
    roots = [(site / "nvidia" / "nccl", "pip's nvidia-nccl wheel", PIP_NCCL_RUNPATH) for site in sites]
    roots += [(toolkit.root, f"the CUDA toolkit at {toolkit.root}", None)] if toolkit else []
    roots += [(root, str(root), None) for root in system_roots]
    for root, found_by, runpath in roots:
        version = nccl_header_version(root / "include")
        library = find_library(root, "libnccl")
        if version and library:
            return Nccl(include=root / "include", library=library, version=version, found_by=found_by,
                        runpath=runpath)
    raise GpuBuildBlocked("torch is a CUDA build but no NCCL was found (HOROVOD_NCCL_HOME, pip's nvidia-nccl "
                          "wheel, the CUDA toolkit, /usr)", install)


def assembled_home(parent: Path, prefix: str, links: Mapping[str, Path],
                   copies: Mapping[str, Path] | None = None) -> Path:
    """A folder of symlinks `{relative name: target}` (and of `copies`) under `parent`, made once, atomically.

    A relative target stays relative (a link inside the folder). The name carries a digest of the
    contents, so another venv gets its own folder; it is built beside its final name and renamed
    into place, so a reader sees all of it or none of it.
    """
    def absolute(target: Path) -> Path:
        return target.resolve() if target.is_absolute() else target

    copies = copies or {}
    entries = [f"{k}\0{absolute(v)}" for k, v in sorted(links.items())]
    entries += [f"{k}\0{v.resolve()}\0{v.stat().st_size}\0{v.stat().st_mtime_ns}" for k, v in sorted(copies.items())]
    home = parent / f"{prefix}-{hashlib.sha256(chr(0).join(entries).encode()).hexdigest()[:10]}"
    if home.is_dir():
        return home
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=parent))
    for name, target in links.items():
        link = staging / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(absolute(target))
    for name, source in copies.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, staging / name)  # same file system: no bytes copied
        except OSError:
            shutil.copy2(source, staging / name)
    try:
        staging.rename(home)
    except OSError:  # another build made it first, from the same links
        shutil.rmtree(staging)
    return home


@dataclass(frozen=True)
class GpuBuild:
    """The toolkit and NCCL a Horovod build with NCCL ops is compiled against."""

    toolkit: CudaToolkit
    nccl: Nccl

    def environment(self, cache: Path) -> dict[str, str]:
        """Variables that point Horovod's CMake, and torch's CUDA_HOME probe, at exactly these."""
        root = self.toolkit.build_root(cache)
        return {"CUDA_HOME": str(root), "HOROVOD_CUDA_HOME": str(root), "CUDAToolkit_ROOT": str(root),
                "CUDACXX": str(root / "bin" / "nvcc"), "HOROVOD_GPU_OPERATIONS": "NCCL",
                **self.nccl.build_env(cache)}


def find_gpu_build(cuda_version: str, env: Mapping[str, str] = os.environ,
                   sites: Sequence[Path] | None = None) -> GpuBuild:
    """Toolkit and NCCL for a torch built against `cuda_version`; GpuBuildBlocked says which is missing."""
    sites = site_dirs() if sites is None else sites
    toolkit = find_toolkit(cuda_version, env, sites)
    return GpuBuild(toolkit=toolkit, nccl=find_nccl(env, sites, toolkit))


def compute_capabilities(nvcc: Path) -> list[int]:
    """What this nvcc compiles kernels for (75, 80, ... as `nvcc --list-gpu-arch` names them); empty if
    it cannot say."""
    try:
        listed = subprocess.run([str(nvcc), "--list-gpu-arch"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({int(cc) for cc in re.findall(r"compute_(\d+)", listed)})


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built for ('13.0'), None for a CPU torch.

    Read from torch/version.py through package metadata: importing torch takes seconds.
    """
    try:
        version_py = Path(metadata.distribution("torch").locate_file("torch/version.py"))
        text = version_py.read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else None
