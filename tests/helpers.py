"""Shared test helpers: launching real horovodrun jobs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def horovodrun_path() -> str:
    """horovodrun beside the running interpreter (the venv), else on PATH."""
    local = Path(sys.executable).with_name("horovodrun")
    found = str(local) if local.exists() else shutil.which("horovodrun")
    if not found:
        pytest.fail("horovodrun not found: run `hvdgen install-horovod` first")
    return found


def run_horovod(np: int, args: list[str], cwd: Path | str | None = None, env: dict | None = None,
                timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run `horovodrun -np N -H localhost:N --gloo <args>` and return the finished process."""
    cmd = [horovodrun_path(), "-np", str(np), "-H", f"localhost:{np}", "--gloo", *args]
    full_env = dict(os.environ)
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc
