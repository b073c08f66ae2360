"""What the tests share: launching real horovodrun jobs, an `mlflow server`, the venv's tools.

The modules beside this one serve fewer tests each: the namespaces that stand in for hosts and
pods (cluster, mpijob_pods, slurm_cluster), the pipeline and tensor-parallel checks
(pipeline_checks, pipeline_jobs, tp_checks), and the suite's CPU budget (budget)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def horovodrun_path() -> str:
    """horovodrun beside the running interpreter (the venv), else on PATH; the warm start's while it
    is on (tests/warm_start: it starts the venv's, forked from a warm interpreter)."""
    from warm_start import bin_folder

    local = Path(bin_folder() or Path(sys.executable).parent) / "horovodrun"
    found = str(local) if local.exists() else shutil.which("horovodrun")
    if not found:
        pytest.fail("horovodrun not found: run `hvdgen install-horovod` first")
    return found


def copy_checkpoint(saved: Path, folder: Path) -> Path:
    """Copy one checkpoint (a file, or torch's folder of shards) into `folder`, made if missing."""
    folder.mkdir(parents=True, exist_ok=True)
    if saved.is_dir():
        return Path(shutil.copytree(saved, folder / saved.name))
    return Path(shutil.copy(saved, folder / saved.name))


def venv_env(**extra: str) -> dict[str, str]:
    """os.environ with this interpreter's folder first on PATH (the venv's horovodrun, python, mlflow),
    after the warm start's `python` while it is on (tests/warm_start)."""
    from warm_start import bin_folder

    first = [folder for folder in (bin_folder(), str(Path(sys.executable).parent)) if folder]
    return {**os.environ, "PATH": os.pathsep.join([*first, os.environ.get("PATH", "")]), **extra}


def importing(project: Path | str) -> dict[str, str]:
    """The environment of a wrapper that imports a generated project's modules (train, model,
    data): the project first on PYTHONPATH, as `python PROJECT/train.py` has its own folder first."""
    return {"PYTHONPATH": str(project)}


def bench_links(**extra: str) -> dict[str, str]:
    """The environment of a pipeline step script: bench/ on PYTHONPATH, for the links built from
    Horovod's collectives (bench/p2p_links.py) it checks beside the socket link."""
    return {"PYTHONPATH": str(REPO / "bench"), **extra}


def python_command(args: list[str]) -> list[str]:
    """A command line with this interpreter named `python`, found on venv_env()'s PATH: the warm
    start's while it is on (tests/warm_start)."""
    from warm_start import bin_folder

    return [("python" if arg == sys.executable else arg) for arg in args] if bin_folder() else list(args)


def run_horovod(np: int, args: list[str], cwd: Path | str | None = None, env: dict | None = None,
                timeout: float = 300, check: bool = True, hosts: str | None = None) -> subprocess.CompletedProcess:
    """Run `horovodrun -np N -H localhost:N --gloo <args>` and return the finished process.

    hosts: another -H, e.g. "localhost:1,127.0.0.1:1": two hosts to Horovod (local ranks, cross
    ranks, HOROVOD_HOSTNAME), both this machine, reached without ssh."""
    cmd = [horovodrun_path(), "-np", str(np), "-H", hosts or f"localhost:{np}", "--gloo", *python_command(args)]
    full_env = venv_env(**(env or {}))
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on a free localhost port: sqlite backend and artifacts under `root`."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        cmd = [str(Path(sys.executable).with_name("mlflow")), "server",
               "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
               "--artifacts-destination", str(root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with self.log.open("w") as log:
            # its own process group: the server forks uvicorn workers, and kill() must stop them all
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_until_up(timeout=180)

    def _wait_until_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.kill()
        pytest.fail(f"mlflow server not up after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def installed_horovod() -> Path:
    """The installed horovod package's folder."""
    spec = util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("horovod is not installed: run `hvdgen install-horovod` first")
    return Path(next(iter(spec.submodule_search_locations)))


def unpatched_files(patches) -> list[str]:
    """The files of the installed horovod that lack one of `patches` (hvdgen/build/patches.py,
    applied in their order): each patch's text must be there, unless a later one rewrote part of it."""
    root = installed_horovod().parent

    def rewritten_later(i: int) -> bool:
        return any(q.path == patches[i].path and q.old in patches[i].new for q in patches[i + 1:])

    return sorted({p.path for i, p in enumerate(patches)
                   if p.new and p.new not in (root / p.path).read_text() and not rewritten_later(i)})
