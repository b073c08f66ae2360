"""Faults of a long run, injected from outside the ranks of real horovodrun jobs: a rank that hangs,
one killed, a stop signal; each ends, or is restarted, with the weights of a run that met no fault.

For both frameworks, data parallel and a 2-stage pipeline (the digits MLP, horovodrun -np 2, 3
epochs, a checkpoint every 10 steps; one run of each without a fault, `straight`, to compare with):

Under the retry launcher (`python -m hvd_runtime.retry --max-restarts 2`):
1. at its 30th step rank 1 holds for a few seconds (PAUSER), in which the test stops it from
   outside (SIGSTOP), as a wedged process would be. Its peer blocks in the step's collective (an
   allreduce; a pipeline's neighbour exchange); with `train.hang_timeout_s 8` rank 0 writes the one
   line naming the step that did not finish, then every thread's stack, in which the frame it
   waits in shows; it exits with the watchdog's status (124), and horovodrun ends the job, the
   stopped rank included, within the timeout + 30 s;
2. the launcher starts the job again; it resumes from the newest checkpoint, and at its own 30th
   step rank 1 is killed from outside (SIGKILL);
3. the third start resumes and finishes: its model.safetensors equals, within 1e-5, the straight
   run's.
A job that fails at the same step every time is given up after its restarts, with one line and
the job's exit status (horovodrun's: 1 for any rank's failure).

Preemption: SIGTERM to horovodrun while rank 1 holds at its 30th step; every rank stops after
the same later step, its checkpoint written, the MLflow run KILLED (the torch data case is
tracked); started again, the job resumes at that step and ends with the straight run's metrics
and weights.

A NaN in one rank's batch at step 15 (NANNER): `skip` skips that update on every rank alike and
trains on, `stop` ends the run with one line; no checkpoint holds a non-finite value, and after
`stop` the newest is the last good one.

A full disk (DISK_FILLER: the checkpoint folder is a 32 MiB tmpfs, filled but for half a
checkpoint after step 11, freed after 25, filled again after 31): the writes in the full windows
fail with one warning each and leave no folder, the one after the disk is freed is written, and
the third failure in a row (more than `checkpoint.max_failures 2`) stops the run in one line;
its newest checkpoint, moved to another disk, resumes to the straight run's weights. The run's
last checkpoint failing stops it, with no trained model written.

The pause only gives the test its moment; the faults and their handling are the real ones. The
stopped and the killed process is the rank itself, also where it starts warm (forked by the
tests' warm start, whose launcher stops, ends and is killed as its rank is:
tests/distributed/test_warm_start.py); the torch data case's hang, kill and stop start cold
(plain_start), as users' ranks do.

Cost: about 230 CPU-s (5.4% of the suite, 2026-12-07): 37 2-rank jobs, 5 of them cold, each fault
in both frameworks and both strategies (a fault's whole point is the restart); the straight runs
are one per case, warm, shared by the file's tests.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from safetensors.numpy import load_file

import warm_start
from helpers import importing, run_horovod
from hvd_runtime.watchdog import HANG_EXIT
from test_fault_tolerance import N_TRAIN, UNTRACKED, Job, checkpoint_steps, metrics
from test_start_up_refusals import generate

pytestmark = pytest.mark.slow
TIMEOUT_S = 8     # the hang timeout: more than the pause, so that a pause alone ends nothing
PAUSE_S = 4
# What the blocked main thread waits in, by framework and strategy: a frame of its stack.
WAITS_IN = {("torch", "data"): r"horovod/torch/mpi_ops\.py\", line \d+ in synchronize",
            ("tensorflow", "data"): r"hvd_runtime/tf/step\.py\", line \d+ in train_batch",
            ("torch", "pipeline"): r"hvd_runtime/pipeline/socket_link\.py\", line \d+ in \w+",
            ("tensorflow", "pipeline"): r"hvd_runtime/pipeline/socket_link\.py\", line \d+ in \w+"}

PAUSER = """\
\"\"\"Run train.py; in its first FAULTS starts, the process of rank 1 writes its pid to FOLDER/at-<start>
when it has trained STEPS steps (and its checkpoint, if one falls there, is written), then ACTS:
`pause` holds PAUSE_S seconds and goes on, `exit` exits with status 3.
usage: PYTHONPATH=<project> python pauser.py FRAMEWORK FOLDER FAULTS STEPS ACT SCRIPT ARGS...\"\"\"
import importlib, os, runpy, sys, time
from pathlib import Path

framework, folder, faults, steps, act, script = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
sys.argv = sys.argv[6:]
folder.mkdir(parents=True, exist_ok=True)
start = len(list(folder.glob("at-*"))) + 1
if os.environ["HOROVOD_RANK"] == "1" and start <= faults:
    cls = importlib.import_module(f"hvd_runtime.{'torch' if framework == 'torch' else 'tf'}.batches").ShardedBatches
    original, trained = cls.batches, [0]

    def batches(self, *args, **kwargs):
        for batch in original(self, *args, **kwargs):
            if self.train:
                if trained[0] == steps:   # asked for the next batch: step STEPS is done
                    (folder / f"at-{start}").write_text(str(os.getpid()))
                    if act == "exit":
                        os._exit(3)
                    time.sleep(PAUSE_S)
                trained[0] += 1
            yield batch

    cls.batches = batches
runpy.run_path(script, run_name="__main__")
"""


NANNER = """\
\"\"\"Run train.py; in its first start, the process of rank RANK makes the inputs of its STEPS-th
training batch NaN. usage: PYTHONPATH=<project> python nanner.py FRAMEWORK RANK STEPS SCRIPT ARGS...\"\"\"
import importlib, os, runpy, sys

framework, rank, steps, script = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.argv = sys.argv[4:]
if os.environ["HOROVOD_RANK"] == rank:
    cls = importlib.import_module(f"hvd_runtime.{'torch' if framework == 'torch' else 'tf'}.batches").ShardedBatches
    original, trained = cls.batches, [0]

    def batches(self, *args, **kwargs):
        for x, y in original(self, *args, **kwargs):
            if self.train:
                trained[0] += 1
                if trained[0] == steps:
                    x = x * float("nan")
            yield x, y

    cls.batches = batches
runpy.run_path(script, run_name="__main__")
"""


DISK_FILLER = """\
\"\"\"Run train.py; the process of rank 0, once it has trained a step named in ACTIONS (its checkpoint,
if one falls there, attempted), fills the file system of DISK but for half the size of the
newest checkpoint there (`fill`), or frees it again (`free`), as another process on the host could.
usage: PYTHONPATH=<project> python disk_filler.py FRAMEWORK DISK STEP:fill|free,... SCRIPT ARGS...\"\"\"
import importlib, os, runpy, sys
from pathlib import Path

framework, disk, script = sys.argv[1], Path(sys.argv[2]), sys.argv[4]
actions = dict(a.split(":") for a in sys.argv[3].split(","))
sys.argv = sys.argv[4:]
filler = disk / "filler"


def act(what):
    if what == "free":
        filler.unlink()
        return
    newest = max(disk.glob("ckpt-*"))
    size = sum(p.stat().st_size for p in newest.iterdir())
    stat = os.statvfs(disk)
    with open(filler, "wb") as f:
        f.write(bytes(stat.f_bavail * stat.f_frsize - size // 2))
        os.fsync(f.fileno())


if os.environ["HOROVOD_RANK"] == "0":
    cls = importlib.import_module(f"hvd_runtime.{'torch' if framework == 'torch' else 'tf'}.batches").ShardedBatches
    original, trained = cls.batches, [0]

    def batches(self, *args, **kwargs):
        for batch in original(self, *args, **kwargs):
            if self.train:
                if str(trained[0]) in actions:
                    act(actions.pop(str(trained[0])))
                trained[0] += 1
            yield batch

    cls.batches = batches
runpy.run_path(script, run_name="__main__")
"""


def pauser(tmp_path: Path, pause_s: float = PAUSE_S) -> Path:
    script = tmp_path / "pauser.py"
    script.write_text(PAUSER.replace("PAUSE_S)", f"{pause_s})"))
    return script


# Every run of a case trains the same: the hang settings change no number.
TRAINING = ["--train.epochs", "3", "--checkpoint.every_steps", "10",
            "--train.hang_timeout_s", str(TIMEOUT_S), "--train.hang_allowance_s", "300"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(project, run folder) of each case's run without a fault, made on first use: with the warm
    start where the suite has it, also for a test whose own ranks start cold (plain_start)."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}
    warm = {name: os.environ[name] for name in (warm_start.VARIABLE, "PATH") if name in os.environ}

    def case(framework: str, strategy: str) -> tuple[Path, Path]:
        if (framework, strategy) not in made:
            root = tmp_path_factory.mktemp(f"straight-{framework}-{strategy}")
            project = generate(root, framework, strategy)
            with mock.patch.dict(os.environ, warm):
                run_horovod(2, [sys.executable, "train.py", *TRAINING, *UNTRACKED, "--run_dir", str(root / "run"),
                                "--checkpoint.dir", str(root / "checkpoints")], cwd=project)
            made[framework, strategy] = project, root / "run"
        return made[framework, strategy]

    return case


def at_start(faults: Path, start: int, job: Job, timeout: float = 300) -> int:
    """The pid rank 1 wrote when it reached its step in start `start`."""
    marker = faults / f"at-{start}"
    deadline = time.monotonic() + timeout
    while not (marker.is_file() and marker.read_text()):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output[-4000:]
        time.sleep(0.02)
    return int(marker.read_text())


def weights(run_dir: Path) -> dict[str, np.ndarray]:
    return load_file(str(run_dir / "model.safetensors"))


# The torch data case starts its ranks as users do, a cold interpreter each (plain_start); the
# others start warm, where the rank stopped or killed is the forked process itself.
CASES = [pytest.param(*case, id="-".join(case), marks=[pytest.mark.plain_start] if case == ("torch", "data") else [])
         for case in WAITS_IN]


@pytest.mark.parametrize("framework, strategy", CASES)
def test_a_hung_then_a_killed_rank_are_restarted_to_the_same_weights(tmp_path, framework, strategy, straight):
    project, straight_run = straight(framework, strategy)
    training = [*TRAINING, *UNTRACKED]
    faults, run_dir, checkpoints = tmp_path / "faults", tmp_path / "run", tmp_path / "checkpoints"
    job = Job(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(pauser(tmp_path)), framework, str(faults), "2",
               "30", "pause", "train.py", *training, "--run_dir", str(run_dir), "--checkpoint.dir", str(checkpoints)],
              cwd=project, env=importing(project), retry=["--max-restarts", "2", "--backoff-s", "0"])
    try:
        os.kill(at_start(faults, 1, job), signal.SIGSTOP)
        stopped = time.monotonic()
        ended, _ = job.wait_for(r"^retry: the job exited with status 1 ", timeout=TIMEOUT_S + 60)
        os.kill(at_start(faults, 2, job), signal.SIGKILL)
        code = job.finish(timeout=300)
    finally:
        if job.proc.poll() is None:
            job.kill()
    out = job.output
    assert code == 0, out[-4000:]
    first, second, third = re.split(r"^retry: the job exited with status 1 .*\n", out, flags=re.M)

    when = "\n".join(f"{stamp - stopped:+6.1f} s {line.rstrip()}" for stamp, line in job.lines if "  File" not in line)
    assert ended - stopped < TIMEOUT_S + 30, f"the job took {ended - stopped:.0f} s to end after rank 1 stopped:\n{when[-3000:]}"
    hangs = re.findall(rf"^\[0\]<stderr>:hang: (step 31 \(epoch \d\)) has not finished in {TIMEOUT_S} s .*$", first, re.M)
    assert len(hangs) == 1, first[-4000:]
    assert not re.search(r"^\[1\]<stderr>:hang:", first, re.M), "the stopped rank cannot have written"
    assert f"Process 0 exit with status code {HANG_EXIT}" in first, first[-3000:]
    stacks = first.split("hang: ", 1)[1]
    assert "Current thread" in stacks and re.search(r"hvd_runtime/loop\.py\", line \d+ in train_epoch", stacks)
    assert re.search(WAITS_IN[framework, strategy], stacks), stacks[-4000:]
    assert "hang:" not in second + third

    # each start resumes the newest checkpoint the one before wrote: 30 before the hang at step 31, 60 before the kill
    assert re.search(rf"^\[0\]<stdout>:resuming from {checkpoints / 'ckpt-000000030'}: epoch \d, step 30$", second, re.M)
    assert "Process 1 exit with status code 137" in second, second[-3000:]
    assert re.search(rf"^\[0\]<stdout>:resuming from {checkpoints / 'ckpt-000000060'}: epoch \d, step 60$", third, re.M)
    assert_same_weights(weights(run_dir), weights(straight_run))


def assert_same_weights(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_job_that_fails_at_the_same_step_every_time_is_given_up(tmp_path, straight):
    project, _ = straight("torch", "data")
    faults = tmp_path / "faults"
    job = Job(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(pauser(tmp_path)), "torch", str(faults), "9",
               "10", "exit", "train.py", "--checkpoint.every_steps", "20", *UNTRACKED,
               "--run_dir", str(tmp_path / "run"), "--checkpoint.dir", str(tmp_path / "checkpoints")],
              cwd=project, env=importing(project), retry=["--max-restarts", "2", "--backoff-s", "0"])
    code = job.finish(timeout=300)
    out = job.output
    assert code == 1, out[-3000:]
    assert out.count("Process 1 exit with status code 3") == 3 and len(list(faults.glob("at-*"))) == 3
    assert re.findall(r"^retry: .*$", out, re.M) == [
        "retry: the job exited with status 1 (no checkpoint yet); restart 1 of 2 in 0 s",
        "retry: the job exited with status 1 (no checkpoint yet); restart 2 of 2 in 0 s",
        "retry: giving up: 2 restarts in a row did not move the newest checkpoint (no checkpoint yet; "
        "--max-restarts 2); exit status 1, the last failure's"]


@pytest.mark.parametrize("framework, strategy", CASES)
def test_a_stop_signal_checkpoints_where_every_rank_stops_and_the_restart_goes_on_exactly(tmp_path, framework,
                                                                                           strategy, straight):
    project, straight_run = straight(framework, strategy)
    tracked = (framework, strategy) == ("torch", "data")
    run_dir, checkpoints, faults = tmp_path / "run", tmp_path / "checkpoints", tmp_path / "faults"
    # log points (where the ranks agree on a stop) every 5 steps and a short hold: the stop fits in
    # horovodrun's 5 s after SIGTERM also where a loaded machine takes 0.7 s a step
    training = [*TRAINING, *([] if tracked else UNTRACKED), "--train.grace_s", "20", "--train.log_every", "5",
                "--run_dir", str(run_dir), "--checkpoint.dir", str(checkpoints)]
    if tracked:
        training += ["--tracking.uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    job = Job(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(pauser(tmp_path, pause_s=0.5)), framework,
               str(faults), "1", "30", "pause", "train.py", *training], cwd=project, env=importing(project))
    try:
        at_start(faults, 1, job)
        job.proc.send_signal(signal.SIGTERM)   # to horovodrun, which sends every rank SIGTERM
        signalled = time.monotonic()
        code = job.finish(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if job.proc.poll() is None:
            job.kill()
    out = job.output
    assert code == 1 and "Exit code: 143" in out, out[-3000:]    # 128 + SIGTERM, passed on by horovodrun
    stops = re.findall(r"^\[0\]<stdout>:stopped on SIGTERM after step (\d+) \(epoch (\d)\), its checkpoint written",
                       out, re.M)
    assert len(stops) == 1 and not re.search(r"^\[1\]<stdout>:stopped", out, re.M), out[-3000:]
    step, epoch = map(int, stops[0])
    per_epoch = math.ceil(math.ceil(N_TRAIN / (2 if strategy == "data" else 1)) / 32)   # steps: 2 replicas or 1
    assert 30 < step < 3 * per_epoch and step % per_epoch and epoch == step // per_epoch, (step, per_epoch)
    assert checkpoint_steps(checkpoints)[-1] == step, "no checkpoint at the step every rank stopped after"
    assert took < 20, f"{took:.0f} s from SIGTERM to the job's end: past train.grace_s"
    if tracked:
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
        assert run.info.status == "KILLED"
        assert max(m.step for m in client.get_metric_history(run.info.run_id, "step_train_loss")) <= step

    resumed = run_horovod(2, [sys.executable, "train.py", *training], cwd=project)
    assert f"resuming from {checkpoints / f'ckpt-{step:09d}'}: epoch {epoch}, step {step}" in resumed.stdout
    by_epoch = {m["epoch"]: m for m in metrics(run_dir)}   # the resumed run's line wins
    for expected in metrics(straight_run)[epoch:]:
        got = by_epoch[expected["epoch"]]
        assert got["step"] == expected["step"], expected["epoch"]
        # the epoch that was cut trained only its rest after the resume: its train totals are partial
        keys = ("val_loss", "val_accuracy") if expected["epoch"] == epoch + 1 else (
            "train_loss", "train_accuracy", "val_loss", "val_accuracy")
        for key in keys:
            assert got[key] == pytest.approx(expected[key], rel=1e-5), (expected["epoch"], key)
    assert_same_weights(weights(run_dir), weights(straight_run))
    if tracked:   # the same run, reopened and finished
        (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
        assert run.info.status == "FINISHED"


def non_finite_tensors(folder: Path) -> list[str]:
    """`file:tensor` of every float tensor holding NaN or inf in the safetensors files under `folder`."""
    return [f"{path.relative_to(folder)}:{name}" for path in sorted(folder.rglob("*.safetensors"))
            for name, a in load_file(str(path)).items()
            if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all()]


@pytest.mark.parametrize("policy", ["skip", "stop"])
@pytest.mark.parametrize("framework, strategy", list(WAITS_IN), ids=["-".join(case) for case in WAITS_IN])
def test_a_nan_in_one_ranks_batch_is_skipped_or_stops_on_every_rank_alike(tmp_path, framework, strategy, policy,
                                                                          straight):
    # the rank whose batch goes bad: a data-parallel replica's, or a pipeline's first stage, which reads x
    project, _ = straight(framework, strategy)
    run_dir, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    nanner = tmp_path / "nanner.py"
    nanner.write_text(NANNER)
    proc = run_horovod(2, [sys.executable, str(nanner), framework, "1" if strategy == "data" else "0", "15",
                           "train.py", "--train.epochs", "1", "--checkpoint.every_steps", "10", "--checkpoint.keep", "9",
                           "--train.on_nonfinite", policy, *UNTRACKED, "--run_dir", str(run_dir),
                           "--checkpoint.dir", str(checkpoints)], cwd=project, env=importing(project), check=False)
    out = proc.stdout + proc.stderr
    said = re.findall(r"^\[(\d)\]<stderr>:nonfinite: (.*)$", out, re.M)
    if policy == "skip":
        assert proc.returncode == 0, out[-4000:]
        assert said == [("0", "the gradients of step 15 are not finite: its update skipped on every rank "
                              "(1 in a row; train.max_skipped 5)")], out[-4000:]
        assert checkpoint_steps(checkpoints)[:2] == [10, 20]
        # a replica or a stage that had applied it would hold NaN now, in its checkpoint and the model
        assert non_finite_tensors(checkpoints) == [] and non_finite_tensors(run_dir) == []
        (epoch,) = metrics(run_dir)
        assert math.isfinite(epoch["train_loss"]), epoch   # the skipped batch is not counted
    else:
        assert proc.returncode != 0, out[-4000:]
        assert said == [("0", "the gradients of step 15 are not finite (NaN or inf in the loss or the gradients; "
                              "train.on_nonfinite stop): stopping before its update, so the weights and the newest "
                              "checkpoint are the last good ones")], out[-4000:]
        assert "Traceback" not in out, out[-4000:]
        assert checkpoint_steps(checkpoints) == [10] and non_finite_tensors(checkpoints) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs mounted at tmp_path/disk for the test (root only), unmounted after it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


@pytest.mark.parametrize("framework, strategy", list(WAITS_IN), ids=["-".join(case) for case in WAITS_IN])
def test_a_full_disk_fails_checkpoints_and_the_run_goes_on_or_stops_with_the_last_good_one(
        tmp_path, framework, strategy, straight, small_disk):
    # full from step 11 to 25 and from 31 on; checkpoints every 10 steps and at each epoch's end
    project, straight_run = straight(framework, strategy)
    training = [*TRAINING, *UNTRACKED, "--checkpoint.max_failures", "2"]
    filler = tmp_path / "disk_filler.py"
    filler.write_text(DISK_FILLER)
    proc = run_horovod(2, [sys.executable, str(filler), framework, str(small_disk), "11:fill,25:free,31:fill",
                           "train.py", *training, "--run_dir", str(tmp_path / "run"),
                           "--checkpoint.dir", str(small_disk)], cwd=project, env=importing(project), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-4000:]
    said = re.findall(r"^\[(\d)\]<stderr>:checkpoint: checkpoint (\d+) was not written, the previous one stays the "
                      r"newest: rank \d could not write its shard in \S+ \((.*)\); (.*)$", out, re.M)
    assert {rank for rank, *_ in said} == {"0"}, out[-4000:]
    assert all("No space left on device" in why for *_, why, _ in said), said
    per_epoch = math.ceil(math.ceil(N_TRAIN / (2 if strategy == "data" else 1)) / 32)   # 23 steps, or 45
    # (step, failed in a row) of each failed write the run went on past; the next stops it
    gone_past = [(20, 1), (23, 2), (40, 1), (46, 2)] if per_epoch == 23 else [(20, 1), (40, 1), (45, 2)]
    goes_on = "training goes on and tries again at the next checkpoint ({} failed in a row; checkpoint.max_failures 2)"
    assert [(int(step), then) for _, step, _, then in said] == [
        *((step, goes_on.format(n)) for step, n in gone_past),
        (50, "3 in a row, more than checkpoint.max_failures 2: stopping at step 50, so that no more is lost than the "
             f"steps since the newest checkpoint: make {small_disk} writable with room for a checkpoint (or choose "
             "another --checkpoint.dir) and launch again to resume from it")], out[-4000:]
    # written where the disk had room, 30 once it was freed; a failed write leaves no folder behind
    assert checkpoint_steps(small_disk) == [10, 30]
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt-000000010", "ckpt-000000030", "filler"]

    # the newest good checkpoint resumes, on another disk, to the weights of a run that met no fault
    moved = tmp_path / "checkpoints"
    shutil.copytree(small_disk / "ckpt-000000030", moved / "ckpt-000000030")
    resumed = run_horovod(2, [sys.executable, "train.py", *training, "--run_dir", str(tmp_path / "resumed"),
                              "--checkpoint.dir", str(moved)], cwd=project)
    assert f"resuming from {moved / 'ckpt-000000030'}: epoch {30 // per_epoch}, step 30" in resumed.stdout
    assert_same_weights(weights(tmp_path / "resumed"), weights(straight_run))


def test_the_runs_last_checkpoint_failing_stops_it_without_a_trained_model(tmp_path, straight, small_disk):
    # the trained model is written from the last checkpoint: a run whose last one failed has none to give
    project, _ = straight("torch", "data")
    filler = tmp_path / "disk_filler.py"
    filler.write_text(DISK_FILLER)
    run_dir = tmp_path / "run"
    proc = run_horovod(2, [sys.executable, str(filler), "torch", str(small_disk), "61:fill", "train.py", *TRAINING,
                           *UNTRACKED, "--checkpoint.max_failures", "5", "--run_dir", str(run_dir),
                           "--checkpoint.dir", str(small_disk)], cwd=project, env=importing(project), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-4000:]
    said = re.findall(r"^\[0\]<stderr>:checkpoint: checkpoint (\d+) was not written, .*; (.*?):", out, re.M)
    assert said == [("69", "it was the run's last checkpoint, which the trained model is written from")], out[-4000:]
    assert checkpoint_steps(small_disk)[-1] == 60 and not (run_dir / "model.safetensors").exists()
