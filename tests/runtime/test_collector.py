"""The garbage collector paused while torch and TensorFlow load (hvd_runtime.collector)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from hvd_runtime.collector import collector_paused

PROBE = """\
import gc, json
collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "stop" else None)
import hvd_runtime.torch
torch_done = len(collections)
import hvd_runtime.tf
print(json.dumps({"torch": torch_done, "tf": len(collections) - torch_done,
                  "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


def test_loading_the_frameworks_collects_almost_nothing_and_leaves_the_collector_on():
    """docs/architecture.md gives the collections the same imports ran without the pause."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["torch"] < 40 and seen["tf"] < 40, seen
    assert seen["enabled"] is True
    assert seen["frozen"] > 100_000, seen  # what the imports made, skipped by later collections


def test_the_pause_collects_nothing_inside_and_freezes_what_exists_after():
    frozen = gc.get_freeze_count()
    try:
        with collector_paused():
            assert not gc.isenabled()
            held = [[i] for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(held)
    finally:
        gc.unfreeze()


def test_a_caller_with_the_collector_off_keeps_it_off_and_nothing_is_frozen():
    gc.disable()
    frozen = gc.get_freeze_count()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.enable()
