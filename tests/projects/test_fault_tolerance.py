"""Fault tolerance of generated torch and TensorFlow projects, proven by killing processes.

- elastic: SIGKILL one of two workers at a known step mid-epoch; the job finishes on the survivor
  with exit 0, rolled back to exactly the last commit before the kill; its step count shows that
  no committed step was lost and none was done twice, and only the rank 0 of the moment wrote
  checkpoints and metrics;
- full restart: kill a whole job mid-epoch, start it again from the newest checkpoint; every
  epoch after that matches an uninterrupted run (1e-5) at exactly the same step;
- corrupt checkpoint: truncate the newest checkpoint; the next start falls back to the previous one.

Cost: over 6% of the suite's CPU (docs/testing.md): each case is a real job killed and resumed or
shrunk, trained past the fault to compare with a run without it; two elastic cases start their ranks
cold (plain_start).
"""

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import horovodrun_path, importing, python_command, run_horovod, venv_env
from hvd_runtime.config import DataConfig
from hvd_runtime.data import load_dataset

pytestmark = pytest.mark.slow
N_TRAIN = len(load_dataset(DataConfig(), seed=42).train)
SCRIPTS = Path(__file__).resolve().parent / "scripts"
NO_TF = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                           reason="TensorFlow is not installed: the TF project is not tested here")
FRAMEWORKS = ["torch", pytest.param("tensorflow", marks=NO_TF)]
# MLflow changes nothing that is trained or checkpointed, and costs a 2-rank job of the digits MLP
# ~8-14 s (its import, a fresh store's migrations, a model logged per epoch in the rank's sender
# thread). Tracked: the elastic jobs whose rank 1 must write nothing (test_data_projects does the
# same for a job that is not elastic), and torch's killed and restarted job, whose store is checked
# (test_elastic_across_hosts checks a new rank 0 taking over the run, with a server).
UNTRACKED = ["--tracking.enabled", "false"]


STOPPER = """\
\"\"\"train_in_rank_dir.py, except that the process started as rank VICTIM stops itself (SIGSTOP) when
it has trained STEPS steps and its hooks (commit, checkpoint) for the last one have run, so that the
test kills it at a known step. usage: python stop_at_step.py FRAMEWORK VICTIM STEPS SCRIPT ARGS...\"\"\"
import os, runpy, signal, sys
from pathlib import Path

framework, victim, steps, script = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.argv = sys.argv[4:]
marker = Path(sys.argv[2]) / f"stopped-rank{victim}"   # a process started later for that rank runs on
if int(os.environ["HOROVOD_RANK"]) == victim and not marker.exists():
    module = "hvd_runtime.torch.batches" if framework == "torch" else "hvd_runtime.tf.batches"
    cls = __import__(module, fromlist=["ShardedBatches"]).ShardedBatches
    original, trained = cls.batches, [0]

    def batches(self, *args, **kwargs):
        for batch in original(self, *args, **kwargs):
            if self.train:
                if trained[0] == steps:     # asked for the next batch: step STEPS is done
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGSTOP)
                trained[0] += 1
            yield batch

    cls.batches = batches
runpy.run_path(script, run_name="__main__")
"""


def generate(out: Path, *flags: str) -> Path:
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--output", str(out), *flags], check=True)
    return out / "proj"


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the checkpoints in `directory` (folders of shards, both frameworks)."""
    return sorted(int(p.name.split("-")[1]) for p in directory.glob("ckpt-*"))


class Job:
    """A horovodrun job in its own process group, its output collected line by line as it comes;
    under the retry launcher (hvd_runtime.retry) with `retry`, its options; `env` adds variables."""

    def __init__(self, args: list[str], cwd: Path, retry: list[str] | None = None, env: dict | None = None):
        env = venv_env(**(env or {}))
        command = [horovodrun_path(), *python_command(args)]
        if retry is not None:
            command = [sys.executable, "-m", "hvd_runtime.retry", *retry, "--", *command]
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern: str, timeout: float = 240) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, line in list(self.lines):
                if re.search(pattern, line):
                    return stamp, line
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.output[-4000:]}")

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.finish()

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)


def worker_pid(rank: int, marker: str) -> int:
    """The training process that horovodrun started as `rank`, found by its environment.

    `marker` is an argument of this job's command line only (a temporary path), so that no
    other job's processes can match.
    """
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"HOROVOD_RANK={rank}".encode() in environ and marker.encode() in cmdline and b"python" in cmdline:
            return int(pid)
    raise AssertionError(f"no training process with rank {rank}")


def wait_until_stopped(rank: int, marker: str, job: Job) -> int:
    """The pid of the training process started as `rank`, once it has stopped itself (state T)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.proc.poll() is None:
        try:
            pid = worker_pid(rank, marker)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                return pid
        except (AssertionError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never stopped at its step:\n{job.output[-3000:]}")


# An elastic job of each framework starts its ranks as users do: a cold interpreter each (plain_start).
@pytest.mark.parametrize("framework, killed, strategy", [
    pytest.param("torch", 1, "data", marks=pytest.mark.plain_start),
    ("torch", 0, "data"),  # the survivor becomes rank 0 and takes over the writing
    ("torch", 1, "model-split"),
    pytest.param("tensorflow", 1, "data", marks=[NO_TF, pytest.mark.plain_start]),
    pytest.param("tensorflow", 0, "data", marks=NO_TF),
    pytest.param("tensorflow", 1, "model-split", marks=NO_TF),
])
def test_elastic_job_survives_a_killed_worker(tmp_path, framework, killed, strategy):
    project = generate(tmp_path, "--framework", framework, "--strategy", strategy, "--elastic")
    epochs, batch, commit_every = 3, 8, 5
    steps_per_epoch = math.ceil(math.ceil(N_TRAIN / 2) / batch)
    # The victim stops (then dies) 2 steps past a commit early in epoch 2: the survivor's last commit
    # is that one, since the next needs steps that the victim never joins.
    stop_after = steps_per_epoch + 2 * commit_every + 2
    rollback = stop_after // commit_every * commit_every
    stopper = tmp_path / "stop_at_step.py"
    stopper.write_text(STOPPER)
    ranks = tmp_path / "ranks"  # each rank runs in ranks/rank<N>, where it was started: what it writes stays there
    job = Job(["-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", "./discover_hosts.sh",
               "--network-interface", "lo", "--gloo", sys.executable, str(stopper), framework, str(killed),
               str(stop_after), str(SCRIPTS / "train_in_rank_dir.py"), str(project), str(ranks),
               "--train.epochs", str(epochs), "--train.batch_size", str(batch),
               "--horovod.elastic_commit_every", str(commit_every), "--checkpoint.every_steps", str(commit_every),
               "--checkpoint.keep", "1000", *([] if killed == 1 and strategy == "data" else UNTRACKED)],
              cwd=project, env=importing(project))
    os.kill(wait_until_stopped(killed, str(ranks), job), signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()
    reset_at, reset = job.wait_for(r"elastic reset: 1 rank\(s\) now")
    assert job.finish() == 0, job.output[-4000:]

    # the default discovery names this machine twice, one rank each: both share its cores
    assert "; 2 on this host" in job.output.split("training on")[0], job.output[-3000:]
    epoch, step, consumed = map(int, re.search(r"epoch (\d+), step (\d+), (\d+) samples", reset).groups())
    assert (epoch, step) == (1, rollback), "not rolled back to the last commit before the kill"
    assert consumed == (step - epoch * steps_per_epoch) * batch * 2
    # From the commit on, one rank trains the rest of that epoch, then whole epochs alone.
    expected = step + math.ceil((N_TRAIN - consumed) / batch) + (epochs - epoch - 1) * math.ceil(N_TRAIN / batch)
    first, survivor = ranks / "rank0", ranks / f"rank{1 - killed}"
    history = metrics(first / "runs" / "latest") + (metrics(survivor / "runs" / "latest") if killed == 0 else [])
    assert [m["epoch"] for m in history] == list(range(1, epochs + 1))
    assert history[-1]["step"] == expected, "a committed step was lost or repeated"
    assert history[-1]["val_accuracy"] > 0.85
    if killed == 1:
        assert not [p for p in (ranks / "rank1").rglob("*") if p.is_file()], "rank 1 must not write anything"
    else:  # the old rank 1 wrote only once it was rank 0: checkpoints after the commit, epochs after the reset
        assert min(checkpoint_steps(survivor / "checkpoints")) > step
        assert metrics(survivor / "runs" / "latest")[0]["epoch"] == epoch + 1
    if framework == "tensorflow":  # the LR follows the world size: at 1 rank it is the one-rank LR
        assert float(re.search(r"lr ([\d.e-]+)", reset).group(1)) == pytest.approx(0.05)

    writer = first if killed == 1 else survivor
    after = min(s for s in checkpoint_steps(writer / "checkpoints") if s > step)
    assert after == step + commit_every, "training did not go on from the commit"
    trained_at = (writer / "checkpoints" / f"ckpt-{after:09d}").stat().st_mtime
    print(f"{framework} {strategy}, rank {killed} killed: reset {reset_at - killed_at:.1f}s after the kill; "
          f"step {after} ({commit_every} steps past the commit) done {trained_at - killed_wall:.1f}s after it")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_full_restart_reaches_the_same_result(tmp_path, framework):
    project = generate(tmp_path, "--framework", framework)
    common = ["--train.epochs", "5", "--checkpoint.every_steps", "10"]
    run_horovod(2, [sys.executable, "train.py", *common, *UNTRACKED, "--run_dir", str(tmp_path / "a"),
                    "--checkpoint.dir", str(tmp_path / "a-ckpt")], cwd=project)

    ckpt = tmp_path / "b-ckpt"
    tracked = framework == "torch"  # the killed job's MLflow run goes on in the restart (the same code for TF)
    args = ["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "train.py", *common,
            *([] if tracked else UNTRACKED),
            "--run_dir", str(tmp_path / "b"), "--checkpoint.dir", str(ckpt)]
    steps_per_epoch = math.ceil(math.ceil(N_TRAIN / 2) / 32)
    job = Job(args, cwd=project)
    deadline = time.monotonic() + 240
    while not any(s % steps_per_epoch for s in checkpoint_steps(ckpt) if s > steps_per_epoch):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output[-3000:]
        time.sleep(0.05)
    job.kill()  # the whole job, mid-epoch, right after a mid-epoch checkpoint
    newest = checkpoint_steps(ckpt)[-1]
    resumed_epoch = newest // steps_per_epoch
    assert resumed_epoch < 4, "killed too late: the last epoch would not be resumed"

    resumed = run_horovod(2, args[5:], cwd=project)
    assert f"resuming from {ckpt / f'ckpt-{newest:09d}'}: epoch {resumed_epoch}, step {newest}" in resumed.stdout
    by_epoch = {m["epoch"]: m for m in metrics(tmp_path / "b")}   # the resumed run's line wins
    for expected in metrics(tmp_path / "a")[resumed_epoch:]:
        got = by_epoch[expected["epoch"]]
        assert got["step"] == expected["step"], expected["epoch"]
        # the epoch that was cut trained only its rest after the resume: its train totals are partial
        partial = expected["epoch"] == resumed_epoch + 1 and newest % steps_per_epoch
        for key in ("val_loss", "val_accuracy") if partial else ("train_loss", "train_accuracy", "val_loss", "val_accuracy"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5), (expected["epoch"], key)
    if tracked:  # one run: the restart reopened the run id its checkpoint holds, and finished it
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
        runs = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
        assert len(runs) == 1, "the restart opened a new MLflow run"
        assert runs[0].info.status == "FINISHED"
        logged = {int(m.value) for m in client.get_metric_history(runs[0].info.run_id, "epoch")}
        assert set(range(resumed_epoch + 1, 6)) <= logged, logged  # the killed job's last ones may be unsent


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_truncated_checkpoint_falls_back_to_the_previous(tmp_path, framework):
    project = generate(tmp_path, "--framework", framework)
    args = [sys.executable, "train.py", "--train.epochs", "2", "--run_dir", str(tmp_path / "run"),
            "--checkpoint.dir", str(tmp_path / "ckpt"), *UNTRACKED]
    run_horovod(2, args, cwd=project)
    newest, previous = sorted((tmp_path / "ckpt").glob("ckpt-*"), reverse=True)[:2]
    damaged = newest / "rank-00000.safetensors"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])

    again = run_horovod(2, [*args[:3], "3", *args[4:]], cwd=project)
    assert "could not be read" in again.stderr + again.stdout
    assert f"resuming from {previous}" in again.stdout
    assert [m["epoch"] for m in metrics(tmp_path / "run")][-2:] == [2, 3]
