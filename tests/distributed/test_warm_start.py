"""The warm start (tests/warm_start) is invisible to a rank: the same job, started cold and warm.

Under real horovodrun, each rank of a probe (scripts/warm_start_probe.py) reports its
environment, arguments, interpreter paths and flags, `__main__`, standard streams, signal state,
umask, resource limits, threads, modules and what it computes; the two runs must agree, but for
the job's own random values (ports, secrets), the parent process (the warm server), the modules
the server imported before the script began, and sys.executable (the tests' `python` that started
it, so that what the rank starts with it starts warm too). Then the ways a process ends: each of a
set of small scripts runs cold and warm, and both must end alike (exit code or signal, output).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm_start
from helpers import REPO, run_horovod, venv_env

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "scripts"
# Values horovodrun draws afresh for every job.
PER_JOB = {"HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_SECRET_KEY"}


@pytest.fixture
def cold(monkeypatch):
    """Within the block, what the test starts starts cold."""
    def turn_off():
        monkeypatch.delenv(warm_start.VARIABLE)
        monkeypatch.setenv("PATH", warm_start.without_bin_folder(os.environ["PATH"]))
    return turn_off


def probe(out: Path, framework: str, profile: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    """The probe's reports and its job. It imports either framework: its profile is named (both runs)."""
    out.mkdir()
    proc = run_horovod(2, [sys.executable, str(SCRIPTS / "warm_start_probe.py"), framework, str(out)], cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "HVDGEN_WARM_PROFILE": profile}, timeout=400)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    shutil.rmtree(out)   # the next run writes to the same path: its arguments are the same
    return reports, proc


def preloaded(profile: str) -> set[str]:
    """The modules a cold interpreter holds after importing what the warm server of `profile` imports."""
    from warm_start import server

    code = (f"import sys, json; [__import__(m) for m in {list(server.PROFILES[profile])!r}]; "
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=venv_env())
    return set(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework, profile", [("torch", "torch"), ("tensorflow", "tf-lean")])
def test_a_rank_cannot_tell_a_warm_start_from_a_cold_one(tmp_path, cold, framework, profile):
    warm, warm_job = probe(tmp_path / "out", framework, profile)
    warm_python = os.path.join(warm_start.bin_folder(), "python")
    cold()
    plain, plain_job = probe(tmp_path / "out", framework, profile)

    parents = [" ".join(r.pop("parent")) for r in (*warm, *plain)]
    assert ["server.py" in parent for parent in parents] == [True, True, False, False], parents
    for r in (*warm, *plain):
        assert len(set(r["results"].pop("numpy_draws_differ_by_rank"))) == 2, "every rank seeds numpy afresh"
    imported_by_the_server = preloaded(profile)
    for w, p in zip(warm, plain):
        # the interpreter each was started as: the tests' `python`, or the one it runs
        assert (w.pop("executable"), p.pop("executable")) == (warm_python, sys.executable)
        warm_env, plain_env = w.pop("environ"), p.pop("environ")
        assert warm_env.pop(warm_start.VARIABLE)
        warm_env["PATH"] = warm_start.without_bin_folder(warm_env["PATH"])
        assert set(warm_env) == set(plain_env)
        assert {k for k in plain_env if warm_env[k] != plain_env[k]} <= PER_JOB
        warm_modules, plain_modules = set(w.pop("modules")), set(p.pop("modules"))
        assert plain_modules <= warm_modules
        assert warm_modules - plain_modules <= imported_by_the_server, "a module the script did not import came along"
        assert w == p
    for proc in (warm_job, plain_job):
        assert "[0]<stdout>:rank 0 says hello" in proc.stdout and "[1]<stdout>:rank 1 says hello" in proc.stdout
        assert "[1]<stderr>:rank 1 warns" in proc.stderr
    assert rank_lines(warm_job) == rank_lines(plain_job), "the ranks wrote other lines to stderr"


def rank_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The ranks' lines of stderr, without the time and thread id of TensorFlow's native log lines."""
    lines = (re.sub(r"^(\[\d+\]<stderr>:[IWE])[0-9]{4} [0-9:.]+ +[0-9]+ ", r"\1", line)
             for line in proc.stderr.splitlines() if line.startswith("["))
    return sorted(lines)


ENDINGS = {
    "exit code": "sys.exit(3)",
    "exit message": "sys.exit('stopped: no data')",
    "exception": "def f():\n    raise ValueError('bad value')\nf()",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "killed by a signal": "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
    "killed outright": "os.kill(os.getpid(), signal.SIGKILL); time.sleep(30)",
    "exit hooks": "import atexit\natexit.register(lambda: print('at exit', flush=True))\nprint('bye', end='')",
    "a thread still running":
        "import threading\nthreading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()",
    "argv and stdin": "print(sys.argv[1:], sys.stdin.read())",
}


def end(tmp_path: Path, body: str, send=None) -> tuple[int, str, str]:
    script = tmp_path / "ending.py"
    script.write_text("import os, signal, sys, time\nimport torch\n" + body + "\n")
    proc = subprocess.Popen(["python", str(script), "a b", "-u"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=venv_env(), cwd=tmp_path)
    if send is not None:
        time.sleep(send[0])
        proc.send_signal(send[1])
    out, err = proc.communicate("typed", timeout=120)
    return proc.returncode, out, err


@pytest.mark.timeout(600)
def test_a_warm_rank_ends_as_a_cold_one(tmp_path, cold):
    """Exit codes, SystemExit messages, tracebacks (the script's frames only), KeyboardInterrupt's
    death by SIGINT, signals, atexit hooks, threads joined at exit, arguments and stdin."""
    warm = {name: end(tmp_path, body) for name, body in ENDINGS.items()}
    cold()
    plain = {name: end(tmp_path, body) for name, body in ENDINGS.items()}
    assert warm == plain
    assert warm["KeyboardInterrupt"][0] == -signal.SIGINT and warm["killed by a signal"][0] == -signal.SIGTERM
    assert warm["killed outright"][0] == -signal.SIGKILL


LOADER = """\
import os, sys
import torch
from torch.utils.data import DataLoader, Dataset
from hvd_runtime.torch.batches import worker_context


class Where(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.tensor([i * i, os.getppid()])   # a worker's parent: the fork server


if __name__ == "__main__":
    os.write(int(sys.argv[1]), b"through the descriptor it was given")
    items = [b.tolist() for b in DataLoader(Where(), batch_size=None, num_workers=2,
                                            multiprocessing_context=worker_context())]
    (fork_server,) = {pid for _, pid in items}
    parent = int(open(f"/proc/{fork_server}/stat").read().rsplit(")", 1)[1].split()[1])
    started_by = open(f"/proc/{parent}/cmdline", "rb").read().split(b"\\0")[1].decode()
    # started by this rank (cold, through a launcher that ran the interpreter), or by another process
    print(sorted(value for value, _ in items), "rank" if parent == os.getpid() else os.path.basename(started_by))
"""


def test_a_warm_ranks_loader_workers_start_warm_and_inherited_descriptors_pass(tmp_path, cold):
    """A descriptor the launch inherits (as `pass_fds` leaves it: the tracking process's socket) is
    the rank's at the same number; a DataLoader's fork server (the runtime's worker_context) starts
    through the launcher, warm, and its workers read what a cold rank's read."""
    script = tmp_path / "loader.py"
    script.write_text(LOADER)

    def run() -> tuple[int, list[str], bytes]:
        read, write = os.pipe()
        try:
            # (with PYTHONDONTWRITEBYTECODE, multiprocessing starts the fork server with -B)
            proc = subprocess.run(["python", str(script), str(write)], pass_fds=[write], capture_output=True,
                                  text=True, env=venv_env(PYTHONDONTWRITEBYTECODE="1"), timeout=180)
        finally:
            os.close(write)
        with os.fdopen(read, "rb") as given:
            return proc.returncode, proc.stdout.split(), given.read()

    warm = run()
    cold()
    plain = run()
    assert warm[0] == plain[0] == 0 and warm[2] == plain[2] == b"through the descriptor it was given"
    assert warm[1][:-1] == plain[1][:-1] == ["[0,", "1,", "4,", "9,", "16,", "25]"]
    assert (warm[1][-1], plain[1][-1]) == ("server.py", "rank"), "the fork server did not start warm"


def test_a_descriptor_the_rank_closes_reads_as_closed_while_it_runs(tmp_path):
    """The launcher keeps no copy of what it handed over: a pipe the rank closes is closed, as a
    cold rank's is (horovodrun's middleman learns that horovodrun died when its pipe closes)."""
    script = tmp_path / "closes.py"
    script.write_text("import os, sys, time\nimport torch\nos.close(int(sys.argv[1]))\ntime.sleep(120)\n")
    read, write = os.pipe()
    launcher = subprocess.Popen(["python", str(script), str(write)], pass_fds=[write], env=venv_env())
    os.close(write)
    try:
        ready = select.select([read], [], [], 60)[0]
        assert ready and os.read(read, 1) == b"" and launcher.poll() is None, "the pipe stayed open"
    finally:
        os.close(read)
        launcher.kill()
        launcher.wait()


def test_a_start_up_hook_on_the_import_path_runs_as_in_a_cold_start(tmp_path):
    """A sitecustomize on PYTHONPATH (the multi-host tests' ranks have one) runs at a cold start; the
    server, started without PYTHONPATH, never ran it, so such a launch starts cold."""
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text("print('hook ran')\n")
    script = tmp_path / "hooked.py"
    script.write_text("import torch\nprint('script ran')\n")
    proc = subprocess.run(["python", str(script)], env=venv_env(PYTHONPATH=str(tmp_path / "hooks")),
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["hook ran", "script ran"], proc.stdout + proc.stderr[-2000:]


PROJECT_TEST = """\
import json, os, subprocess, sys
from pathlib import Path

import __main__


def test_report():
    rank = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, check=True).stdout
    started_by = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\\0")[1].decode()
    report = {"argv0": os.path.basename(sys.argv[0]), "path": sys.path[:3], "main": __main__.__spec__.name,
              "main_file": os.path.basename(__main__.__file__), "orig_argv": sys.orig_argv[1:],
              "rank": rank.split()[0], "pytest": os.path.basename(started_by), "rank_started_by": rank.split()[1]}
    Path(os.environ["REPORT"]).write_text(json.dumps(report))
"""

PROJECT_TRAIN = """\
import os
from pathlib import Path

import torch

parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\\0")[1].decode()
print(torch.ones(3).sum().item(), os.path.basename(parent))
"""


def test_a_projects_pytest_and_the_ranks_it_starts_run_warm(tmp_path, cold):
    """`python -m pytest` in a generated project's folder (`make test`) is forked from the server of
    the framework its train.py imports, runs as `-m` runs it, and the rank its test starts with
    sys.executable is forked warm too."""
    project = tmp_path / "proj"
    (project / "tests").mkdir(parents=True)
    (project / "train.py").write_text(PROJECT_TRAIN)
    (project / "tests" / "test_it.py").write_text(PROJECT_TEST)

    def run(name: str) -> dict:
        report = tmp_path / f"{name}.json"
        proc = subprocess.run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=project,
                              capture_output=True, text=True, env=venv_env(REPORT=str(report)), timeout=300)
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(report.read_text())

    warm = run("warm")
    cold()
    plain = run("cold")
    assert (warm.pop("pytest"), warm.pop("rank_started_by")) == ("server.py", "server.py"), "not started warm"
    assert "server.py" not in (plain.pop("pytest"), plain.pop("rank_started_by"))
    assert warm == plain
    assert warm["main"] == "pytest.__main__" and warm["rank"] == "3.0"


TRACKED = """\
import sys
import torch  # noqa: F401  (a torch rank's tracking process)
from hvd_runtime.tracking.remote import RemoteSink

sink = RemoteSink(sys.argv[1], "pytorch")
print(sink.open_run({"experiment": "warm"}), flush=True)
sys.stdin.readline()
sink.close()
"""


def test_rank0s_tracking_process_starts_warm(tmp_path):
    """hvd_runtime.tracking.remote starts its process with multiprocessing's interpreter, so a warm
    rank's goes through the launcher and is forked from a tracking server (MLflow imported once)."""
    script = tmp_path / "tracked.py"
    script.write_text(TRACKED)
    rank = subprocess.Popen(["python", str(script), f"sqlite:///{tmp_path / 'mlflow.db'}"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=venv_env(), cwd=tmp_path)
    try:
        assert len(rank.stdout.readline().strip()) == 32, "no run opened"
        servers = _servers("tracking-torch")
        assert servers and _forked_by(servers), "the tracking process was not forked from a warm server"
    finally:
        rank.communicate("\n", timeout=60)
    assert rank.returncode == 0


HELD = """\
import os, sys, time
from pathlib import Path

Path(sys.argv[1], os.environ["HOROVOD_RANK"]).write_text(str(os.getpid()))
while not Path(sys.argv[1], "go").exists():
    time.sleep(0.05)
"""


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1 and _stat(pid):
        pid = int(_stat(pid)[1])
        chain.append(pid)
    return chain


@pytest.mark.timeout(300)
def test_horovodrun_and_its_middlemen_start_warm(tmp_path, cold):
    """The tests' horovodrun (helpers.horovodrun_path) is forked from the `runner` server, which
    imported horovod.runner once, and so are the per-rank middlemen it starts through
    multiprocessing's spawn: the server's children are an ancestor of each rank (its middleman) and
    two more that write to the launcher's own output (horovodrun, and the resource tracker it
    starts for its semaphores). Cold, the server has none."""
    from helpers import horovodrun_path

    script = tmp_path / "held.py"
    script.write_text(HELD)

    def run(out: Path, servers: set[int]) -> tuple[set[int], set[int]]:
        out.mkdir()
        job = subprocess.Popen([horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo", "python", str(script),
                                str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=venv_env())
        try:
            deadline = time.monotonic() + 120
            while not all((out / r).exists() and (out / r).read_text() for r in "01"):
                assert time.monotonic() < deadline and job.poll() is None, job.stdout.read().decode()[-3000:]
                time.sleep(0.05)
            forked = _forked_by(servers)
            output = os.readlink(f"/proc/{job.pid}/fd/1")
            writing = {pid for pid in forked if _fd(pid, 1) == output}
            ranks = [int((out / r).read_text()) for r in "01"]
            middlemen = {pid for pid in forked if any(pid in _ancestors(rank) for rank in ranks)}
            (out / "go").write_text("")
            assert job.wait(timeout=120) == 0, job.stdout.read().decode()[-3000:]
            return writing, middlemen
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()

    # (a worker may hold several runner servers: one per value of the variables read at start-up)
    writing, middlemen = run(tmp_path / "warm", _servers("runner"))
    assert len(middlemen) == 2, "the ranks' middlemen did not start warm"
    assert len(writing - middlemen) == 2, "horovodrun (and the resource tracker it starts) did not start warm"
    servers = _servers("runner")   # the same servers, still running: a cold job forks nothing from them
    cold()
    assert servers and run(tmp_path / "cold", servers) == (set(), set())


def _servers(profile: str) -> set[int]:
    """The pids of this worker's warm servers of `profile` (one per value of the load-time variables)."""
    return {int(p.read_text()) for p in Path(warm_start.bin_folder()).parent.glob(f"{profile}-*/pid")}


def _forked_by(servers: set[int]) -> set[int]:
    """The processes those servers forked that are running now."""
    return {pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if int((_stat(pid) or [0, 0])[1]) in servers}


def _fd(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def started(tmp_path: Path, body: str) -> tuple[subprocess.Popen, int]:
    """A launcher running a torch script that has begun `body`, and its rank's pid."""
    marker = tmp_path / "started"
    script = tmp_path / "long.py"
    script.write_text(f"import os, time\nimport torch\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n{body}\n")
    launcher = subprocess.Popen(["python", str(script)], env=venv_env())
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    rank = int(marker.read_text())
    marker.unlink()
    assert rank != launcher.pid, "not started warm"
    return launcher, rank


def gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while _state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    return _state(pid) in (None, "Z")


@pytest.mark.timeout(300)
def test_signals_reach_a_warm_rank_and_a_killed_launcher_takes_it_along(tmp_path):
    """SIGTERM to the launcher reaches the rank; a launcher killed outright (as horovodrun's clean-up
    kills a process group) leaves no rank behind; a rank that stops itself stops its launcher."""
    launcher, rank = started(tmp_path, "time.sleep(120)")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == -signal.SIGTERM and gone(rank)

    launcher, rank = started(tmp_path, "os.kill(os.getpid(), signal.SIGSTOP)\ntime.sleep(120)".replace(
        "signal.SIGSTOP", str(int(signal.SIGSTOP))))
    deadline = time.monotonic() + 30
    while _state(launcher.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(rank) == "T" and _state(launcher.pid) == "T", "the launcher did not stop with its rank"
    launcher.kill()
    launcher.wait(timeout=30)
    assert gone(rank), "the rank outlived its launcher"


@pytest.mark.timeout(300)
def test_a_signal_as_the_rank_ends_is_no_error_of_the_launcher(tmp_path):
    """horovodrun stops the other ranks with SIGTERM once one has failed, which may be the moment a
    rank ends on its own: the launcher then has a signal for a rank that has gone (seen in the
    suite: ProcessLookupError's traceback in a refused job's output). Here the rank ignores
    SIGTERM and exits 3 while signals keep coming: the launcher must end as it did, quietly."""
    script = tmp_path / "short.py"
    script.write_text("import signal, sys, time\nimport torch\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('started', flush=True)\ntime.sleep(0.05)\nsys.exit(3)\n")
    for _ in range(30):   # the rank ignores SIGTERM, so the signals keep coming until it has ended
        launcher = subprocess.Popen(["python", str(script)], env=venv_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        assert launcher.stdout.readline() == "started\n"
        while launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            time.sleep(0.0005)
        assert launcher.returncode == 3, launcher.stderr.read()[-2000:]
        assert "Traceback" not in launcher.stderr.read()


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, parent, ...); None once it has gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _state(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0] if fields else None
