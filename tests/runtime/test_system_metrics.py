"""Each host's readings, under the names MLflow 3's own system-metrics monitors give them.

The gather across hosts is checked where it runs, under horovodrun with two hosts, in
tests/projects/test_tracking_project.py.
"""

from __future__ import annotations

import pytest

from hvd_runtime.config import load_config
from hvd_runtime.tracking.system import HostSampler, SystemMetrics, node_id, start_system_metrics


def mlflow_names() -> set[str]:
    """What MLflow's CPU, disk and network monitors call their readings, read from the monitors."""
    pytest.importorskip("mlflow")
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    names = set()
    for monitor in (CPUMonitor(), DiskMonitor(), NetworkMonitor()):
        monitor.collect_metrics()
        names |= set(monitor.metrics)
    return names


def test_readings_carry_mlflows_names_and_sane_values():
    sampler = HostSampler()
    sum(i * i for i in range(200_000))  # some CPU time to count
    readings = sampler.sample()
    assert {k for k in readings if not k.startswith("gpu_")} == mlflow_names()
    assert 0.0 <= readings["cpu_utilization_percentage"] <= 100.0
    assert 0.0 < readings["system_memory_usage_percentage"] < 100.0
    assert readings["network_receive_megabytes"] >= 0.0 and readings["disk_available_megabytes"] > 0.0


def test_node_id_prefers_mlflows_variable_then_horovods_host(monkeypatch):
    monkeypatch.setenv("HOROVOD_HOSTNAME", "10.0.0.2")
    assert node_id() == "10.0.0.2"
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_NODE_ID", "worker-1")
    assert node_id() == "worker-1"


@pytest.mark.parametrize("overrides", [["tracking.system_metrics=false"], ["tracking.enabled=false"]])
def test_off_by_config_is_off_on_every_rank_without_a_collective(overrides):
    metrics = start_system_metrics(load_config(overrides=overrides), framework="torch")
    assert not metrics.enabled and metrics.hvd is None and metrics.gather() == {}


def test_disabled_needs_no_horovod():
    assert SystemMetrics(False, "no.such.module").gather() == {}
