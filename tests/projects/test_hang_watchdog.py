"""A hung job ends: a rank stopped from outside (SIGSTOP) ends the job through the others' watchdogs.

For both frameworks, data parallel and a 2-stage pipeline (MLP, horovodrun -np 2): once training
is past its first steps, rank 1 is stopped as a wedged process would be. Its peer blocks in the
step's collective (an allreduce; a pipeline's neighbour exchange), and without a watchdog the job
would wait for ever. With `train.hang_timeout_s 5`: rank 0 writes the one line naming the step
that did not finish, then every thread's stack, in which the frame it waits in shows; it exits
with the watchdog's status (124); horovodrun ends the job, the stopped rank included, within the
timeout + 30 s. No checkpoint is written by the hung step.

The ranks start cold (plain_start): the stopped process must be the rank itself, as on a cluster.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hvd_runtime.watchdog import HANG_EXIT
from test_fault_tolerance import Job, worker_pid
from test_start_up_refusals import generate

pytestmark = pytest.mark.slow
TIMEOUT_S = 5
# What the blocked main thread waits in, by framework and strategy: a frame of its stack.
WAITS_IN = {("torch", "data"): r"horovod/torch/mpi_ops\.py\", line \d+ in synchronize",
            ("tensorflow", "data"): r"hvd_runtime/tf/step\.py\", line \d+ in train_batch",
            ("torch", "pipeline"): r"hvd_runtime/pipeline/socket_link\.py\", line \d+ in \w+",
            ("tensorflow", "pipeline"): r"hvd_runtime/pipeline/socket_link\.py\", line \d+ in \w+"}


@pytest.mark.plain_start
@pytest.mark.parametrize("framework, strategy", list(WAITS_IN), ids=["-".join(case) for case in WAITS_IN])
def test_a_stopped_rank_ends_the_job_with_every_stack(tmp_path, framework, strategy):
    project = generate(tmp_path, framework, strategy)
    run_dir, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    # 5,000 steps an epoch: the job is mid-epoch, steps of milliseconds, when rank 1 stops
    job = Job(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "train.py", "--train.epochs", "1",
               "--tracking.enabled", "false",
               "--train.hang_timeout_s", str(TIMEOUT_S), "--train.hang_allowance_s", "300",
               "--data.source", "synthetic", "--data.synthetic_samples", "400000",
               "--run_dir", str(run_dir), "--checkpoint.dir", str(checkpoints)], cwd=project)
    try:
        job.wait_for(r"\[0\]<stderr>:epoch 0: .* \d{2,}/\d+ \[", timeout=300)   # a progress line: past the first steps
        os.kill(worker_pid(1, str(run_dir)), signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            code = job.finish(timeout=TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs {TIMEOUT_S + 60} s after rank 1 stopped:\n{job.output[-4000:]}")
        took = time.monotonic() - stopped
    finally:
        if job.proc.poll() is None:
            job.kill()
    out = job.output
    assert code != 0, out[-3000:]
    when = "\n".join(f"{stamp - stopped:+6.1f} s {line.rstrip()}" for stamp, line in job.lines if "  File" not in line)
    assert took < TIMEOUT_S + 30, f"the job took {took:.0f} s to end after rank 1 stopped:\n{when[-3000:]}"
    hangs = re.findall(r"^\[0\]<stderr>:hang: (step \d+ \(epoch 0\)) has not finished in 5 s .*$", out, re.M)
    assert len(hangs) == 1, out[-4000:]
    assert not re.search(r"^\[1\]<stderr>:hang:", out, re.M), "the stopped rank cannot have written"
    assert f"Process 0 exit with status code {HANG_EXIT}" in out, out[-3000:]
    stacks = out.split("hang: ", 1)[1]
    assert "Current thread" in stacks and re.search(r"hvd_runtime/loop\.py\", line \d+ in train_epoch", stacks)
    assert re.search(WAITS_IN[framework, strategy], stacks), stacks[-4000:]
    assert not checkpoints.exists() or not any(checkpoints.iterdir()), "a checkpoint from the hung epoch"
