"""The hang watchdog (hvd_runtime.watchdog) in a process of its own: when it ends one and when not.

What a real hung job does with it (a peer stopped under horovodrun): tests/projects/test_run_faults.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from hvd_runtime.config import ConfigError, load_config
from hvd_runtime.watchdog import HANG_EXIT

PRELUDE = """\
import threading, time
from types import SimpleNamespace
from hvd_runtime import watchdog

def wedged():   # a collective that never completes
    threading.Event().wait()
"""


def run(body: str) -> subprocess.CompletedProcess:
    """Run PRELUDE + body; a watchdog that fails to fire shows as this timeout, not as a pass."""
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=120)


def test_a_late_beat_ends_the_process_naming_what_and_every_stack():
    proc = run("""
        watchdog.start(SimpleNamespace(hang_timeout_s=1, hang_allowance_s=600))
        for step in range(1, 4):
            watchdog.beat(f"step {step}")
        wedged()
    """)
    assert proc.returncode == HANG_EXIT, proc.stderr
    first, *stacks = proc.stderr.splitlines()
    assert first.startswith("hang: step 3 has not finished in 1 s (train.hang_timeout_s / train.hang_allowance_s)")
    assert any(line.endswith(" in wedged") for line in stacks), proc.stderr
    assert any(line.startswith("Current thread") for line in stacks) and any(line.startswith("Thread") for line in stacks)


def test_a_step_after_a_long_allowance_is_held_to_the_step_timeout():
    # start-up's allowance is 10 minutes; the step that follows it has 1 s, and that is what ends it
    proc = run("""
        watchdog.start(SimpleNamespace(hang_timeout_s=1, hang_allowance_s=600))
        watchdog.beat("step 1")
        wedged()
    """)
    assert proc.returncode == HANG_EXIT, proc.stderr
    assert proc.stderr.startswith("hang: step 1 has not finished in 1 s"), proc.stderr


def test_beats_in_time_a_stopped_watchdog_and_a_zero_timeout_end_nothing():
    proc = run("""
        watchdog.start(SimpleNamespace(hang_timeout_s=1, hang_allowance_s=1))
        for step in range(20):
            watchdog.beat(f"step {step}")
            time.sleep(0.1)
        watchdog.stop()
        time.sleep(2)   # past the last beat's time: stopped, it stays quiet
        assert watchdog.start(SimpleNamespace(hang_timeout_s=0, hang_allowance_s=1)) is None
        watchdog.beat("step 20")
        time.sleep(2)
        print("done")
    """)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "done\n", "")


def test_allowance_is_at_least_the_step_timeout_and_stall_warnings_come_first():
    proc = run("""
        import os
        w = watchdog.start(SimpleNamespace(hang_timeout_s=300, hang_allowance_s=10))
        print(w.allowance_s, os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"])
        watchdog.stop()
    """)
    assert proc.stdout.split() == ["300", "60"], proc.stderr


@pytest.mark.parametrize("key", ["train.hang_timeout_s", "train.hang_allowance_s"])
def test_a_negative_time_is_refused_in_one_line(key):
    with pytest.raises(ConfigError, match=rf"^{key} must be 0 or more, got -1.0$"):
        load_config(None, [f"--{key}", "-1"])


def test_a_limit_ends_the_process_after_stop_and_without_a_hang_timeout():
    # preemption's grace time: held whatever the beats say, with the watchdog off, and after stop()
    proc = run("""
        watchdog.start(SimpleNamespace(hang_timeout_s=0, hang_allowance_s=0))
        watchdog.limit(1, "the stop SIGTERM asked for has not finished in 1 s (train.grace_s)")
        watchdog.beat("step 1", allowance=True)
        watchdog.stop()
        wedged()
    """)
    assert proc.returncode == HANG_EXIT, proc.stderr
    assert proc.stderr.startswith("hang: the stop SIGTERM asked for has not finished in 1 s (train.grace_s): "
                                  "ending this rank (exit 124) before its time is up. Every thread's stack:"), proc.stderr


def test_waiting_for_a_slow_tracking_server_to_open_the_run_is_not_a_hung_step(tmp_path):
    # a checkpoint stores the run's id, and asking for it waits while the server opens the run: here
    # one that answers nothing, each request given up after 3 s, three times the step timeout
    server = socket.create_server(("127.0.0.1", 0))
    try:
        proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(f"""
            from hvd_runtime.config import load_config
            from hvd_runtime.tracking import start_tracking
            tracker = start_tracking(load_config(), rank=0, world_size=1, framework="torch", strategy="data",
                                     project_name="slow", tracking_uri="http://127.0.0.1:{server.getsockname()[1]}")
            watchdog.start(SimpleNamespace(hang_timeout_s=1, hang_allowance_s=60))
            watchdog.beat("step 10")
            print(tracker.run_id)
            watchdog.stop()
            tracker.close(timeout=1)
        """)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    finally:
        server.close()
    assert (proc.returncode, proc.stdout) == (0, "None\n"), proc.stderr
