"""The retry launcher (python -m hvd_runtime.retry) around a job of its own: when it restarts, when it gives up.

The job here is a small script that plays a training job's part as the launcher sees it: it
publishes a checkpoint folder (`ckpt-<step>/index.json`) of the step it gets to, and exits with a
status; each attempt appends its arguments to a file. What a real job does under it (a rank
killed or stopped under horovodrun, then resumed to the uninterrupted run's weights):
tests/projects/test_retry_launcher.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from hvd_runtime.checkpoint import newest_step

# Run in a folder holding plan.json: attempt n (from 1) does plan[n - 1] (the last for later ones),
# [the step it publishes a checkpoint of or null, its exit status]. Its checkpoint folder is its
# first argument, or, with a config.yaml beside it as a project's train.py has, that config's.
JOB = """\
import json, sys
from pathlib import Path
config = Path(sys.argv[0]).with_name("config.yaml")
if config.is_file():
    from hvd_runtime.config import load_config
    checkpoints = Path(load_config(config, sys.argv[1:]).checkpoint.dir)
else:
    checkpoints = Path(sys.argv[1])
attempts = Path("attempts.jsonl")
with attempts.open("a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
plan = json.loads(Path("plan.json").read_text())
step, code = plan[min(len(attempts.read_text().splitlines()), len(plan)) - 1]
if step is not None:
    (checkpoints / f"ckpt-{step:09d}").mkdir(parents=True, exist_ok=True)
    (checkpoints / f"ckpt-{step:09d}" / "index.json").write_text("{}")
sys.exit(code)
"""


def retry(tmp_path: Path, plan: list, *args: str) -> list[str]:
    """The launcher's command line, run in tmp_path with `plan` (see JOB)."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return [sys.executable, "-m", "hvd_runtime.retry", *args]


def launch(tmp_path: Path, plan: list, *options: str, script: Path | None = None) -> subprocess.Popen:
    if script is None:
        script = tmp_path / "job.py"
        script.write_text(JOB)
    checkpoints = tmp_path / "checkpoints"
    return subprocess.Popen(retry(tmp_path, plan, *options, "--checkpoint-dir", str(checkpoints), "--",
                                  sys.executable, str(script), str(checkpoints)),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen) -> tuple[int, list[str]]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, [line for line in err.splitlines() if line.startswith("retry:")]


def attempts(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]


def test_a_job_that_succeeds_runs_once_and_says_nothing(tmp_path):
    code, lines = finished(launch(tmp_path, [[10, 0]]))
    assert (code, lines, len(attempts(tmp_path))) == (0, [], 1)


def test_failures_that_move_the_checkpoint_are_restarted_until_the_job_finishes(tmp_path):
    # five failures with one restart allowed: each attempt got further, so none is a crash loop
    plan = [[10, 1], [20, 1], [30, 1], [40, 1], [50, 1], [60, 0]]
    code, lines = finished(launch(tmp_path, plan, "--max-restarts", "1", "--backoff-s", "0.01"))
    assert code == 0 and len(attempts(tmp_path)) == 6
    assert lines == [f"retry: the job exited with status 1 (newest checkpoint at step {s}); restart 1 of 1 in 0.01 s"
                     for s in (10, 20, 30, 40, 50)]
    assert newest_step(tmp_path / "checkpoints") == 60


def test_a_crash_loop_is_given_up_with_one_line_and_the_last_status(tmp_path):
    # the first attempt gets to step 10, every later one fails before its next checkpoint
    code, lines = finished(launch(tmp_path, [[10, 3], [None, 3]], "--max-restarts", "2", "--backoff-s", "0.01"))
    assert code == 3 and len(attempts(tmp_path)) == 3      # the first attempt, then the 2 restarts allowed
    assert lines == ["retry: the job exited with status 3 (newest checkpoint at step 10); restart 1 of 2 in 0.01 s",
                     # the backoff doubles while the step stands still
                     "retry: the job exited with status 3 (newest checkpoint at step 10); restart 2 of 2 in 0.02 s",
                     "retry: giving up: 2 restarts in a row did not move the newest checkpoint "
                     "(newest checkpoint at step 10; --max-restarts 2); exit status 3, the last failure's"]


def test_no_restart_allowed_passes_the_status_through_silently(tmp_path):
    code, lines = finished(launch(tmp_path, [[None, 7]], "--max-restarts", "0"))
    assert (code, lines, len(attempts(tmp_path))) == (7, [], 1)


# The second attempt waits for SIGTERM, and says which signal it got.
WAITS = JOB.replace("sys.exit(code)\n", """\
if len(attempts.read_text().splitlines()) == 2:
    import signal, time
    def stop(signum, frame):
        (checkpoints.parent / "stopped").write_text(signal.Signals(signum).name)
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
    (checkpoints.parent / "waiting").touch()
    time.sleep(60)
sys.exit(code)
""")


def test_a_signal_to_the_launcher_goes_to_the_job_and_ends_the_retries(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    proc = launch(tmp_path, [[10, 1], [20, 1]], "--max-restarts", "3", "--backoff-s", "0", script=script)
    deadline = time.monotonic() + 60
    while not (tmp_path / "waiting").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)   # a scheduler's warning ahead of its limit: the job gets SIGTERM
    code, lines = finished(proc)
    assert code == 143 and (tmp_path / "stopped").read_text() == "SIGTERM"
    assert len(attempts(tmp_path)) == 2 and len(lines) == 1   # the one restart before the signal, none after


def project(tmp_path: Path, checkpoint: dict) -> Path:
    """A script with a config.yaml beside it, as a generated project has."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "train.py").write_text(JOB)
    (folder / "config.yaml").write_text(json.dumps({"checkpoint": checkpoint}))
    return folder / "train.py"


def test_the_checkpoint_folder_is_the_jobs_config_with_its_overrides(tmp_path):
    script = project(tmp_path, {"dir": "elsewhere"})
    command = retry(tmp_path, [[10, 1], [None, 1]], "--max-restarts", "1", "--backoff-s", "0", "--",
                    sys.executable, str(script), "--checkpoint.dir", "mine")
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and len(attempts(tmp_path)) == 2
    assert "newest checkpoint at step 10" in proc.stderr, proc.stderr   # read where the override puts it
    assert newest_step(tmp_path / "mine") == 10 and not (tmp_path / "elsewhere").exists()


def test_a_job_that_starts_over_resumes_what_it_wrote_when_restarted(tmp_path):
    script = project(tmp_path, {"resume": False})
    command = retry(tmp_path, [[10, 1], [20, 0]], "--max-restarts", "2", "--backoff-s", "0", "--",
                    sys.executable, str(script))
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert attempts(tmp_path) == [[], ["--checkpoint.resume", "true"]]
    assert newest_step(tmp_path / "checkpoints") == 20


def test_a_bad_config_is_one_line_and_runs_nothing(tmp_path):
    script = project(tmp_path, {"kept": 3})
    proc = subprocess.run(retry(tmp_path, [[None, 0]], "--", sys.executable, str(script)),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and not (tmp_path / "attempts.jsonl").exists()
    assert proc.stderr.splitlines() == ["config error: unknown config key checkpoint.kept: valid keys are "
                                        "dir, every_steps, keep, max_failures, resume"]
    bare = subprocess.run(retry(tmp_path, [[None, 0]], "--", sys.executable, "-c", "pass"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and bare.stderr.splitlines()[-1] == (
        "Error: no script in the command has a config.yaml beside it: name the job's checkpoint folder "
        "with --checkpoint-dir")


def test_a_job_ended_by_a_signal_passes_the_shells_status(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvd_runtime.retry", "--max-restarts", "0", "--checkpoint-dir",
                           str(tmp_path), "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + 9, proc.stderr
