"""Ranks that start in milliseconds for the test suite: a warm interpreter forks each one.

`install()` (a session fixture in tests/conftest.py) writes launcher.py as `python`, `python3`
and `horovodrun` into a folder of its own and puts that folder first on PATH, so every `python
...` a test starts, horovodrun's ranks included, goes through it: a script that imports torch or
TensorFlow (or a generated project's `python -m pytest`) is forked from server.py, a process
that imported that framework once (nothing initialised, no thread started), with the launch's
own process state taken over; horovodrun and the processes it starts are forked from one that
imported horovod.runner; anything else runs the real interpreter.
tests/distributed/test_warm_start.py shows a rank cannot tell.

What a rank can still tell: its parent process is the server, not horovodrun's shell; its
sys.executable is the warm `python` it was started as (so a process it starts with it, a
generated project's test starting its ranks say, starts warm too), not the interpreter that one
runs; its string hashes share one seed with the other ranks of its kind (PYTHONHASHSEED, drawn
once per server); the imports it shares were made before its script began (a torch rank's
torch._dynamo too, which a cold rank imports at its first optimizer step, and matplotlib's pyplot,
which a pipeline's rank 0 imports to draw its timeline: server.LATER). Tests marked
`plain_start` run without it, so the start-up users get is still exercised for every framework
and strategy.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from multiprocessing import spawn
from pathlib import Path

VARIABLE = "HVDGEN_WARM_START"
LAUNCHER = Path(__file__).with_name("launcher.py")
PREFIX = "hvdwarm."


_installed: list[Path] = []   # the folder install() made in this process
_executables: list[str] = []   # multiprocessing's interpreter before it


def server_pids() -> list[int]:
    """The warm servers this process's install() has started (while a test has it turned off too)."""
    pids = []
    for root in _installed:
        for pid_file in root.glob("*/pid"):
            try:
                pids.append(int(pid_file.read_text()))
            except (OSError, ValueError):
                pass
    return pids


def bin_folder() -> str | None:
    """The folder holding the warm `python`, while the warm start is on."""
    warm = os.environ.get(VARIABLE)
    return os.path.join(warm.rsplit(":", 2)[0], "bin") if warm else None


def without_bin_folder(path: str) -> str:
    """PATH without any warm `python` folder."""
    return os.pathsep.join(p for p in path.split(os.pathsep)
                           if not (Path(p).name == "bin" and Path(p).parent.name.startswith(PREFIX)))


def install() -> Path:
    """Turn the warm start on for this process and what it starts; returns its folder."""
    root = Path(tempfile.mkdtemp(prefix=PREFIX, dir="/tmp"))   # short: a socket path has 108 bytes
    (root / "bin").mkdir()
    server = repr(str(LAUNCHER.with_name("server.py")))
    launcher = f"#!{sys.executable} -IS\n" + LAUNCHER.read_text().replace(
        'os.path.join(os.path.dirname(os.path.realpath(__file__)), "server.py")', server)
    names = ["python", "python3"]
    if Path(sys.executable).with_name("horovodrun").exists():   # horovodrun too, and what it starts
        names.append("horovodrun")
    for name in names:
        (root / "bin" / name).write_text(launcher)
        (root / "bin" / name).chmod(0o755)
    netns = os.stat("/proc/self/ns/net").st_ino
    os.environ[VARIABLE] = f"{root}:{os.getpid()}:{netns}"
    os.environ["PATH"] = f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    # What this process starts through multiprocessing (a tracking process, a DataLoader's fork
    # server, for a test that runs the runtime in-process) goes through the launcher too.
    _executables.append(spawn.get_executable())
    multiprocessing.set_executable(str(root / "bin" / "python"))
    _installed.append(root)
    return root


def uninstall(root: Path) -> None:
    """Stop every server this process started and remove the folder."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()   # this process's own (an in-process DataLoader's), forked from a server
    for pid in server_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _installed.remove(root)
    multiprocessing.set_executable(_executables.pop())
    os.environ.pop(VARIABLE, None)
    os.environ["PATH"] = without_bin_folder(os.environ["PATH"])
    shutil.rmtree(root, ignore_errors=True)
