"""horovodrun's start-up in the wheel hvdgen builds: how Horovod was built is read from its
extension libraries, not by importing a framework (hvdgen/build/patches.py, LAUNCHER_PATCHES).

Unpatched, every `horovodrun` imported TensorFlow in a forked process before starting any rank:
seconds per job, and TensorFlow's log lines in the output of a PyTorch job. The exit statuses a
job ends with survive the launcher's own threads (its middlemen, a terminated job's shells).
"""

import json
import subprocess
import sys
from importlib import util
from pathlib import Path

import pytest

from helpers import horovodrun_path, run_horovod, unpatched_files
from hvdgen.build.patches import LAUNCHER_PATCHES

SCRIPTS = Path(__file__).resolve().parent / "scripts"
FRAMEWORKS = [name for name in ("torch", "tensorflow") if util.find_spec(name) is not None]


def test_installed_horovod_carries_the_launcher_patches():
    stale = unpatched_files(LAUNCHER_PATCHES)
    assert not stale, f"the installed horovod lacks hvdgen's patches to {stale}: run `hvdgen install-horovod --force`"


def build_flags(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_build_flags_read_without_the_framework_agree_with_its_module(framework):
    """The light reading answers what `horovod.<framework>` itself answers, and imports no framework.
    Two processes: Horovod's library, once loaded globally, must come after its framework's import."""
    flags = "[bool(getattr(hvd, f + '_built')()) for f in ('gloo', 'mpi', 'nccl', 'cuda')]"
    light = build_flags(f"""
import sys
from horovod.common import util
hvd = util._compiled_flags({framework!r})
assert hvd is not None, 'the extension library did not load without its framework'
assert not {{'torch', 'tensorflow'}} & set(sys.modules), 'a framework was imported'
print({flags})
""")
    assert light == build_flags(f"import horovod.{framework} as hvd; print({flags})")
    assert light.startswith("[True"), f"this build has no Gloo: {light}"


@pytest.mark.skipif("torch" not in FRAMEWORKS, reason="PyTorch is not installed")
def test_a_torch_job_starts_without_tensorflow_in_its_output():
    proc = run_horovod(2, [sys.executable, "-c", "import horovod.torch as hvd; hvd.init(); print('size', hvd.size())"])
    assert proc.stdout.count("size 2") == 2, proc.stdout
    output = proc.stdout + proc.stderr
    assert "cudart_stub" not in output and "absl::InitializeLog" not in output, output[-3000:]


@pytest.mark.parametrize("np, rank_code, verdict", [
    (3, "pass", "horovodrun: error: Requested more processes (3) than there are available slots (2)"),
    (2, "import sys; sys.exit(3)", "horovodrun: error: Horovod detected that one or more processes exited with "
                                   "non-zero status"),
], ids=["too-few-slots", "a-rank-failed"])
def test_a_failed_launch_ends_in_one_line(np, rank_code, verdict):
    """horovodrun's own verdicts end in one line (exit 1), not a traceback of its internals."""
    proc = subprocess.run([horovodrun_path(), "-np", str(np), "-H", "localhost:2", "--gloo", sys.executable, "-c",
                           rank_code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(verdict), proc.stderr[-3000:]


def test_a_rank_s_exit_status_survives_another_thread_reaping_its_middleman():
    """execute() returns the command's status even when another thread's waitpid reaped the middleman
    (scripts/reaped_middleman.py). That thread wins one run in six on a quiet machine and more under
    load, so an unpatched Horovod returns None in some of the 30 runs (checked: it did, from the
    second run on); with the patch every run gives 3."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "reaped_middleman.py"), "30"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [3] * 30


def test_a_shell_that_ended_keeps_its_exit_status_when_its_job_is_terminated():
    """A job stopped by a signal (horovodrun sent SIGTERM) runs terminate_executor_shell_and_children
    on each rank's shell while the middleman waits on it. A shell that has just ended must still
    give the middleman its exit status: reaped by the terminating thread instead, Popen.wait() read
    the lost status as 0, and horovodrun ended a preempted job (ranks 143) with exit 0."""
    import psutil
    from horovod.runner.common.util.safe_shell_exec import terminate_executor_shell_and_children

    shell = subprocess.Popen(["sh", "-c", "exit 3"])
    proc = psutil.Process(shell.pid)
    while proc.status() != psutil.STATUS_ZOMBIE:   # ended, not yet waited for: the middleman's moment
        pass
    terminate_executor_shell_and_children(shell.pid)
    assert shell.wait(timeout=10) == 3
