"""Horovod's background loop in the wheel hvdgen builds wakes when a tensor is queued
(hvdgen/build/patches.py, PERFORMANCE_PATCHES; hvd_runtime.scaling.set_cycle_time turns it on
for CPU ranks).

The job below runs under a ten-minute cycle. Unpatched, the loop sleeps a whole cycle before each
negotiation, so its first allreduce alone would outlast the test's timeout; patched, every
allreduce starts when its tensor is queued, including one that a rank queues late (the other
rank's request goes back on the queue and waits in the next negotiation, not for a cycle), and
the job's shutdown does not wait for a cycle either.
"""

import sys

import pytest

from helpers import run_horovod

pytest.importorskip("torch")

JOB = r"""
import time

import horovod.torch as hvd
import torch

hvd.init()
rank, size = hvd.rank(), hvd.size()
expected = sum(range(size)) / size
for step in range(12):
    if step % 3 == 1 and rank == step % size:  # one rank queues this one late, in turn
        time.sleep(0.3)
    assert hvd.allreduce(torch.tensor([float(rank)]), name="value").item() == expected
    # a step's gradients as one group, each tensor waited for as the optimizer does
    tensors = [torch.full((n,), float(rank + step)) for n in (3, 1000, 7)]
    handle = hvd.grouped_allreduce_async_(tensors, name="group")
    for out in hvd.synchronize(handle):
        assert torch.allclose(out, torch.full_like(out, expected + step)), (step, out)
print("done", rank, flush=True)
"""


def test_collectives_start_when_queued_not_after_a_cycle():
    ten_minutes = {"HOROVOD_CYCLE_TIME": "600000", "HOROVOD_WAKE_ON_ENQUEUE": "1"}
    proc = run_horovod(2, [sys.executable, "-c", JOB], env=ten_minutes, timeout=120)
    assert sorted(line for line in proc.stdout.splitlines() if "done" in line)[-2:] == ["[0]<stdout>:done 0",
                                                                                       "[1]<stdout>:done 1"]
