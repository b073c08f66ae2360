"""A user's error ends the run in one line from rank 0 (hvd_runtime.errors), in real processes.

Rank 0 prints the line and exits 1. Another rank prints nothing when the launcher ends it (SIGTERM)
while it waits; it prints the line itself when nothing ends it (a problem rank 0 did not meet);
an elastic job's rank exits at once and quietly. The rank is the launcher's: horovodrun's, Open
MPI's, MPICH's and PMIx's, Slurm's. Whole-job refusals under horovodrun: tests/projects/test_start_up_refusals.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_runtime.config import ConfigError
from hvd_runtime.data import DataError
from hvd_runtime.errors import UserError, launch_rank

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from hvd_runtime import errors, watchdog
from hvd_runtime.config import ConfigError, TrainConfig
errors.LINGER_S = float(sys.argv[1])
if len(sys.argv) > 2:   # a watchdog that a beat-less second would trip
    watchdog.start(TrainConfig(hang_timeout_s=0.3, hang_allowance_s=0.3))
print("ready", flush=True)
errors.end_run(ConfigError("data.path 'x' is not a file: point it at one"))
"""


def end_run(linger_s: float, *watched: str, **launcher_env: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID",
                        "HOROVOD_ELASTIC")}
    env.update(launcher_env, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(linger_s), *watched], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


LINE = "config error: data.path 'x' is not a file: point it at one\n"


def test_rank_0_prints_the_line_and_exits_1():
    proc = end_run(60)
    assert proc.wait(timeout=30) == 1 and proc.stderr.read() == LINE


def test_another_rank_ended_by_the_launcher_says_nothing():
    proc = end_run(60, HOROVOD_RANK="1")
    time.sleep(0.5)
    assert proc.poll() is None, "it waits for the launcher to end it"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 1 and proc.stderr.read() == ""


def test_another_rank_nothing_ends_prints_the_line_itself():
    """A problem only that rank met: rank 0 never stopped, so no launcher ends it."""
    proc = end_run(0.2, OMPI_COMM_WORLD_RANK="1")
    assert proc.wait(timeout=30) == 1 and proc.stderr.read() == LINE


def test_the_wait_does_not_trip_the_hang_watchdog():
    proc = end_run(1.0, "watched", HOROVOD_RANK="1")
    assert proc.wait(timeout=30) == 1 and proc.stderr.read() == LINE


def test_an_elastic_rank_exits_at_once_and_quietly():
    proc = end_run(60, HOROVOD_RANK="1", HOROVOD_ELASTIC="1")
    assert proc.wait(timeout=10) == 1 and proc.stderr.read() == ""


@pytest.mark.parametrize("variable", ["HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                                      "SLURM_PROCID"])
def test_the_rank_is_the_launchers(monkeypatch, variable):
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert launch_rank() == 0
    monkeypatch.setenv(variable, "3")
    assert launch_rank() == 3


def test_config_and_data_errors_are_user_errors_with_their_word():
    assert issubclass(DataError, ConfigError) and issubclass(ConfigError, UserError)
    assert (UserError.kind, ConfigError.kind, DataError.kind) == ("error", "config error", "config error")
