"""A CPU rank keeps the memory it frees (hvd_runtime.host_memory): a step's tensors reuse pages.

Counted in page faults, not time: each test runs a fresh interpreter (glibc's settings last for
the process), which allocates and frees what a training step would, several times over, and
reports the minor page faults of the last rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hvd_runtime.host_memory import keep_freed_memory, user_chose_allocator

PAGES_A_STEP = (64 + 16) * 2**20 // 4096   # what STEPS allocates and frees in a step, in 4 KiB pages
STEPS = """
import json, resource, sys
import numpy as np
from hvd_runtime.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
if sys.argv[1] == "torch-rank":   # what a generated project's rank runs first, on the CPU
    from hvd_runtime.torch.context import init_horovod
    kept = str(init_horovod().device)

def step():
    # a step's activations and gradients: 64 blocks of 1 MiB and two of 8 MiB, then all freed
    held = [np.ones(2**18, np.float32) for _ in range(64)] + [np.ones(2 * 2**20, np.float32) for _ in range(2)]
    del held

for _ in range(2):   # the first steps grow the heap
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(mode: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
               and not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", STEPS, mode], env=environ,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_steps_after_the_first_reuse_their_pages():
    default, kept = faults("default"), faults("keep")
    assert kept["kept"] is True
    # glibc's defaults: most of every step's memory comes back as new pages
    assert default["faults"] > 5 * PAGES_A_STEP // 2, default
    # kept: the pages of the first steps serve every later one
    assert kept["faults"] < PAGES_A_STEP // 20, (kept, default)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_torch_cpu_rank_keeps_its_freed_memory_from_the_start():
    pytest.importorskip("horovod.torch", reason="Horovod is not installed: run hvdgen install-horovod")
    rank = faults("torch-rank")
    assert rank["kept"] == "cpu"
    assert rank["faults"] < PAGES_A_STEP // 20, rank


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
                                 {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}],
                         ids=["MALLOC_", "GLIBC_TUNABLES", "preloaded allocator"])
def test_the_users_own_allocator_settings_win(env):
    assert user_chose_allocator(env)
    assert keep_freed_memory(env) is False


def test_an_unrelated_environment_is_not_a_choice():
    assert not user_chose_allocator({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "LD_PRELOAD": "libfoo.so"})
