"""Every host's system metrics in the job's one MLflow run, under MLflow 3's own names.

MLflow 3 samples a host when a run starts with `log_system_metrics=True` and, given a node id,
logs `system/<node_id>/cpu_utilization_percentage` and the like, so that processes on several hosts
can share one run. Under Horovod that would make a process on every host write to the server, and
here no rank but 0 ever writes tracking data. So each host's local rank 0 samples its own host,
the samples meet at rank 0 once per epoch (one allgather of a few numbers, every rank taking part),
and rank 0 logs them with MLflow's names: the MLflow UI's system-metrics charts show every host.

The sampling is psutil's (and pynvml's for NVIDIA GPUs, where it is installed), as MLflow's own
monitors do, without importing MLflow on ranks that never log. CPU utilization is the mean over
the epoch (psutil's count since the last call); memory, disk and GPU readings are taken at the
epoch's end; network traffic counts from the job's start, as MLflow's network monitor counts it.

The node id is, in order: MLFLOW_SYSTEM_METRICS_NODE_ID (MLflow's own variable), the host name
horovodrun launched the rank on (HOROVOD_HOSTNAME: what `-H` says, so two hosts that share a
machine name stay apart), or the machine's name.
"""

from __future__ import annotations

import importlib
import os
import socket

import psutil

HOROVOD_MODULES = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow"}
PREFIX = "system/"


def node_id() -> str:
    return (os.environ.get("MLFLOW_SYSTEM_METRICS_NODE_ID") or os.environ.get("HOROVOD_HOSTNAME")
            or socket.gethostname())


class HostSampler:
    """This host's readings, named and counted as MLflow's system-metrics monitors do."""

    def __init__(self, disk_path: str = "/"):
        self.disk_path = disk_path
        psutil.cpu_percent(interval=None)   # the first call only starts psutil's count
        self._network_start = psutil.net_io_counters()
        self._gpus = _nvml_handles()

    def sample(self) -> dict[str, float]:
        memory = psutil.virtual_memory()
        disk = psutil.disk_usage(self.disk_path)
        network = psutil.net_io_counters()
        readings = {
            "cpu_utilization_percentage": psutil.cpu_percent(interval=None),
            "system_memory_usage_megabytes": memory.used / 1e6,
            "system_memory_usage_percentage": memory.used / memory.total * 100,
            "disk_usage_percentage": disk.percent,
            "disk_usage_megabytes": disk.used / 1e6,
            "disk_available_megabytes": disk.free / 1e6,
            "network_receive_megabytes": (network.bytes_recv - self._network_start.bytes_recv) / 1e6,
            "network_transmit_megabytes": (network.bytes_sent - self._network_start.bytes_sent) / 1e6,
        }
        readings.update(_gpu_readings(self._gpus))
        return readings


def _nvml_handles() -> list:
    """NVIDIA GPUs through pynvml (the nvidia-ml-py package), if it is installed and finds a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no package, no driver, no GPU: no GPU readings
        return []


def _gpu_readings(handles: list) -> dict[str, float]:
    if not handles:
        return {}
    import pynvml

    readings = {}
    for i, handle in enumerate(handles):
        try:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            readings[f"gpu_{i}_memory_usage_percentage"] = memory.used / memory.total * 100
            readings[f"gpu_{i}_memory_usage_megabytes"] = memory.used / 1e6
            readings[f"gpu_{i}_utilization_percentage"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # noqa: BLE001 - one GPU that stops answering costs its readings only
            continue
    return readings


class SystemMetrics:
    """Call `gather()` on every rank at the same point of each epoch; rank 0 gets every host's readings."""

    def __init__(self, enabled: bool, horovod_module: str | None = None):
        self.enabled = enabled
        self.hvd = importlib.import_module(horovod_module) if enabled and horovod_module else None
        self.sampler = HostSampler() if enabled else None
        self.node = node_id()

    def gather(self) -> dict[str, float]:
        """{"system/<node>/<reading>": value} for every host on rank 0, {} on the others.

        A collective: every rank must call it, in the same place. Asked each time who samples
        (local rank 0), since an elastic job's ranks move between hosts."""
        if not self.enabled:
            return {}
        mine = (self.node, self.sampler.sample()) if self.hvd.local_rank() == 0 else None
        everyone = self.hvd.allgather_object(mine, name="hvd_runtime.system_metrics")
        if self.hvd.rank() != 0:
            return {}
        return {f"{PREFIX}{node}/{key}": value for node, readings in filter(None, everyone)
                for key, value in readings.items()}


def start_system_metrics(config, framework: str) -> SystemMetrics:
    """On when tracking is and `tracking.system_metrics` is: the same answer on every rank, since
    it is read from the config alone (the gather is a collective)."""
    section = getattr(config, "tracking", None)
    enabled = bool(getattr(section, "enabled", True) and getattr(section, "system_metrics", True))
    return SystemMetrics(enabled, HOROVOD_MODULES[framework])
