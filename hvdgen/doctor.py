"""`hvdgen doctor`: what this environment has, and whether a generated project can run here.

Besides versions it shows what the installed Horovod was built with (controllers, tensor ops, from
`horovodrun --check-build`) and, for a CUDA torch, the toolkit and NCCL a rebuild would use. A
Horovod whose GPU ops do not fit the torch beside it (a CUDA torch but no NCCL ops, NCCL ops but
a CPU torch) still runs, so that is a warning; anything that stops a project is a problem and
makes the command exit non-zero.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import click

from hvdgen.build.checks import build_mismatches, gpu_toolchain, parse_check_build
from hvdgen.build.cuda import torch_cuda_version
from hvdgen.build.horovod_wheel import installed_wheel_url


def horovodrun_path() -> str | None:
    """horovodrun of this interpreter's environment (its bin dir need not be on PATH), else PATH's."""
    beside = Path(sys.executable).with_name("horovodrun")
    return str(beside) if beside.exists() else shutil.which("horovodrun")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.startswith("GPU")] if out.returncode == 0 else []


def _mpi() -> str | None:
    if not shutil.which("mpirun"):
        return None
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).strip().splitlines()[0] if out.returncode == 0 else "mpirun (version unknown)"


def _enabled(section: dict[str, bool]) -> str:
    return ", ".join(name for name, on in section.items() if on) or "none"


def _slurm(project: Path) -> list[str]:
    """Inside a Slurm allocation: what it gave, and, in a project's folder, why it does not fit
    the project's layout."""
    from hvdgen.slurm.allocation import allocation

    found = allocation(os.environ)
    if found is None:
        return []
    click.echo(f"slurm        {found.describe()}")
    from hvdgen.spec import SPEC_FILE, ProjectSpec   # PyYAML: where doctor may find nothing but click

    if not (project / SPEC_FILE).is_file():
        return []
    from hvdgen.slurm.check import layout_problems

    spec = ProjectSpec.from_yaml((project / SPEC_FILE).read_text())
    if not found.even:
        return [f"the allocation runs {','.join(map(str, found.tasks_per_node))} tasks on its nodes; the project's "
                "ranks need the same on each: submit with --ntasks-per-node"]
    problems = [f"this allocation does not fit {project.name}: {message}"
                for _, message in layout_problems(spec, found.nodes, found.tasks_per_node[0], found.gpus_per_node)]
    if not problems:
        click.echo(f"  fits         {spec.strategy}: {found.tasks} ranks, {found.tasks // spec.model_ranks} "
                   f"cop{'y' if found.tasks // spec.model_ranks == 1 else 'ies'} of the model")
    return problems


def run_doctor() -> int:
    """Print the report; return 0 when a generated project can run, 1 otherwise."""
    problems: list[str] = []
    warnings: list[str] = []
    torch, tf = _version("torch"), _version("tensorflow") or _version("tensorflow-cpu")
    torch_cuda = torch_cuda_version() if torch else None
    click.echo(f"python       {sys.version.split()[0]} ({sys.executable})")
    if torch:
        click.echo(f"torch        {torch} ({f'CUDA {torch_cuda}' if torch_cuda else 'CPU'} build)")
        if torch_cuda:
            click.echo(f"  gpu build    {gpu_toolchain(torch_cuda, tf)}")
    else:
        click.echo("torch        not installed")
    click.echo(f"tensorflow   {tf or 'not installed'}")
    if not torch and not tf:
        problems.append("no framework installed: pip install 'hvdgen[torch]'")

    horovodrun = horovodrun_path()
    if _version("horovod") is None or horovodrun is None:
        click.echo("horovod      not installed")
        problems.append("horovod is missing: run hvdgen install-horovod")
    else:
        out = subprocess.run([horovodrun, "--check-build"], capture_output=True, text=True)
        build = parse_check_build(out.stdout)
        frameworks = build.get("Frameworks", {})
        click.echo(f"horovod      {_version('horovod')}")
        click.echo(f"  frameworks   {_enabled(frameworks)}")
        click.echo(f"  controllers  {_enabled(build.get('Controllers', {}))}")
        click.echo(f"  tensor ops   {_enabled(build.get('Tensor Operations', {}))}")
        wheel = installed_wheel_url()
        if wheel:
            click.echo(f"  wheel        {wheel}")
        if torch:
            warnings += build_mismatches(torch_cuda, build.get("Tensor Operations", {}), tf)
        for name, installed in (("PyTorch", torch), ("TensorFlow", tf)):
            if installed and not frameworks.get(name):
                problems.append(f"horovod was built without {name} support although {name} is installed: "
                                "run hvdgen install-horovod --force")
        if not any(build.get("Controllers", {}).values()):
            problems.append("horovod has no controller (Gloo or MPI): run hvdgen install-horovod --force")

    gpus = _gpus()
    click.echo(f"gpus         {len(gpus)}" + "".join(f"\n  {g}" for g in gpus))
    click.echo(f"mpi          {_mpi() or 'not found (Gloo is used; fine on one machine)'}")
    problems += _slurm(Path.cwd())

    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    for problem in problems:
        click.echo(f"problem: {problem}", err=True)
    if problems:
        return 1
    click.echo("ok: this environment can run generated projects")
    return 0
