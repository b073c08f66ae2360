"""Horovod's cycle time as the runtime sets it before hvd.init: by device, the user's word first; and
the ranks that share this machine's cores."""

from __future__ import annotations

import os

import pytest

from hvd_runtime import scaling
from hvd_runtime.scaling import (CPU_CYCLE_TIME_MS, STAGGERED_CPU_CYCLE_TIME_MS, WAKING_CPU_CYCLE_TIME_MS,
                                 cpu_threads, ranks_on_this_machine, set_cycle_time)

SETTINGS = ("HOROVOD_CYCLE_TIME", "HOROVOD_WAKE_ON_ENQUEUE")


@pytest.fixture
def env(monkeypatch):
    """os.environ without Horovod's cycle settings, as it was again afterwards (set_cycle_time
    writes to it)."""
    for name in SETTINGS:
        monkeypatch.setenv(name, "")  # recorded first, so undoing restores the original
        monkeypatch.delenv(name)
    return os.environ


@pytest.fixture(params=[True, False], ids=["waking-horovod", "other-horovod"])
def waking(request, monkeypatch):
    """Whether the installed Horovod can wake on enqueue: hvdgen's build can, another cannot."""
    monkeypatch.setattr(scaling, "horovod_wakes_on_enqueue", lambda: request.param)
    return request.param


def test_the_installed_horovod_wakes_on_enqueue():
    assert scaling.horovod_wakes_on_enqueue(), "run `hvdgen install-horovod --force`: this Horovod lacks the patch"


def test_cpu_ranks_sleep_until_a_tensor_is_queued_where_horovod_can(env, waking):
    set_cycle_time(0.0, gpu=False)
    if waking:
        assert env["HOROVOD_WAKE_ON_ENQUEUE"] == "1"
        assert env["HOROVOD_CYCLE_TIME"] == f"{WAKING_CPU_CYCLE_TIME_MS:g}"
    else:  # a Horovod that sleeps whole cycles keeps the short cycle measured for it
        assert "HOROVOD_WAKE_ON_ENQUEUE" not in env
        assert env["HOROVOD_CYCLE_TIME"] == f"{CPU_CYCLE_TIME_MS:g}"


def test_staggered_ranks_wake_their_idle_loops_often(env, waking):
    """A pipeline's tensor-parallel stages: one stage's collectives wait for every idle loop's next cycle."""
    set_cycle_time(0.0, gpu=False, staggered=True)
    assert env["HOROVOD_CYCLE_TIME"] == f"{STAGGERED_CPU_CYCLE_TIME_MS:g}"
    assert STAGGERED_CPU_CYCLE_TIME_MS < WAKING_CPU_CYCLE_TIME_MS
    assert ("HOROVOD_WAKE_ON_ENQUEUE" in env) == waking  # still woken by its own work


def test_gpu_ranks_keep_horovods_own_loop(env, waking):
    set_cycle_time(0.0, gpu=True)
    assert not set(SETTINGS) & set(env)


def test_the_wake_up_can_be_turned_off(env, waking):
    env["HOROVOD_WAKE_ON_ENQUEUE"] = "0"
    set_cycle_time(0.0, gpu=False)
    assert env["HOROVOD_WAKE_ON_ENQUEUE"] == "0"
    assert env["HOROVOD_CYCLE_TIME"] == f"{CPU_CYCLE_TIME_MS:g}"


@pytest.mark.parametrize("gpu", [False, True])
def test_a_configured_cycle_time_is_used_on_any_device(env, waking, gpu):
    set_cycle_time(2.5, gpu=gpu)
    assert env["HOROVOD_CYCLE_TIME"] == "2.5"


def test_horovod_cycle_time_in_the_environment_wins_over_config_and_default(env):
    env["HOROVOD_CYCLE_TIME"] = "0.5"
    set_cycle_time(0.0, gpu=False)
    set_cycle_time(3.0, gpu=True)
    assert env["HOROVOD_CYCLE_TIME"] == "0.5"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.1.1", "::1"])
def test_ranks_on_loopback_names_all_share_this_machine(monkeypatch, host):
    """An elastic project's default discovery names this machine twice (localhost:1, 127.0.0.1:1):
    Horovod gives each rank a local size of 1, and each took every core."""
    monkeypatch.setenv("HOROVOD_HOSTNAME", host)
    assert ranks_on_this_machine(local_size=1, size=2) == 2
    assert cpu_threads(ranks_on_this_machine(local_size=1, size=2)) == cpu_threads(2)


@pytest.mark.parametrize("host", ["node1", "10.0.0.7", "", None])
def test_ranks_on_named_hosts_are_horovods_local_ranks(monkeypatch, host):
    if host is None:
        monkeypatch.delenv("HOROVOD_HOSTNAME", raising=False)
    else:
        monkeypatch.setenv("HOROVOD_HOSTNAME", host)
    assert ranks_on_this_machine(local_size=4, size=8) == 4
