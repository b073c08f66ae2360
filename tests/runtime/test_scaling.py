"""Horovod's cycle time as the runtime sets it before hvd.init: by device, the user's word first."""

from __future__ import annotations

import os

import pytest

from hvd_runtime.scaling import CPU_CYCLE_TIME_MS, set_cycle_time


@pytest.fixture
def env(monkeypatch):
    """os.environ without HOROVOD_CYCLE_TIME, as it was again afterwards (set_cycle_time writes to it)."""
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "")  # recorded first, so undoing restores the original
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    return os.environ


def test_cpu_ranks_get_the_measured_cpu_cycle_and_gpu_ranks_keep_horovods_default(env):
    set_cycle_time(0.0, gpu=False)
    assert env["HOROVOD_CYCLE_TIME"] == f"{CPU_CYCLE_TIME_MS:g}"
    del env["HOROVOD_CYCLE_TIME"]
    set_cycle_time(0.0, gpu=True)
    assert "HOROVOD_CYCLE_TIME" not in env


@pytest.mark.parametrize("gpu", [False, True])
def test_a_configured_cycle_time_is_used_on_any_device(env, gpu):
    set_cycle_time(2.5, gpu=gpu)
    assert env["HOROVOD_CYCLE_TIME"] == "2.5"


def test_horovod_cycle_time_in_the_environment_wins_over_config_and_default(env):
    env["HOROVOD_CYCLE_TIME"] = "0.5"
    set_cycle_time(0.0, gpu=False)
    set_cycle_time(3.0, gpu=True)
    assert env["HOROVOD_CYCLE_TIME"] == "0.5"
