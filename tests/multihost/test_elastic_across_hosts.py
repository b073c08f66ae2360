"""An elastic MPIJob across hosts: rank 0's host is lost mid-epoch and comes back (tests/helpers/mpijob_pods.py)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import venv_env
from helpers.mpijob_pods import generated_job, launcher_argv, start_worker, worker_pods

pytestmark = pytest.mark.slow


PACER = '''\
"""sitecustomize for the elastic test's ranks (on PYTHONPATH, which horovodrun passes to every rank).

HVDT_FRAMEWORK's ShardedBatches is patched: the process started as rank 0 stops itself (SIGSTOP) once it has trained HVDT_STOP_AFTER steps,
leaving its host name in HVDT_MARKER, so that the test kills its host at a known step. While the
world is smaller than HVDT_FULL_SIZE, every step takes at least 0.2 s: the job is still training
when the host comes back, whatever this machine's speed (each wait is far below Gloo's timeout).
"""
import os, signal, socket, time
from pathlib import Path

if os.environ.get("HOROVOD_HOSTNAME"):
    if os.environ["HVDT_FRAMEWORK"] == "torch":
        from hvd_runtime.torch.batches import ShardedBatches
    else:
        from hvd_runtime.tf.batches import ShardedBatches

    marker, full = Path(os.environ["HVDT_MARKER"]), int(os.environ["HVDT_FULL_SIZE"])
    victim = os.environ.get("HOROVOD_RANK") == "0" and not marker.exists()
    stop_after, trained, shrunk = int(os.environ["HVDT_STOP_AFTER"]), [0], [False]
    batches, reshard = ShardedBatches.batches, ShardedBatches.reshard

    def paced_batches(self, *args, **kwargs):
        for batch in batches(self, *args, **kwargs):
            if self.train:
                if victim and trained[0] == stop_after:
                    marker.write_text(socket.gethostname())
                    os.kill(os.getpid(), signal.SIGSTOP)
                trained[0] += 1
                if shrunk[0]:
                    time.sleep(0.2)
            yield batch

    def noting_reshard(self, rank, size):
        shrunk[0] = size < full
        return reshard(self, rank, size)

    ShardedBatches.batches, ShardedBatches.reshard = paced_batches, noting_reshard
'''


def delivered(db: Path, key: str, value: float, launcher: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Wait until the MLflow store holds a run with metric `key` at `value` (the server writes it)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        if any(m.value == value for run in runs for m in client.get_metric_history(run.info.run_id, key)):
            return
        time.sleep(0.5)
    pytest.fail(f"the server never got {key} {value} from rank 0:\n{log.read_text()[-4000:]}")


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r}:\n{log.read_text()[-4000:]}")


def write_discovery(path: Path, pods) -> None:
    """discover_hosts.sh as the v2 operator writes it: the running worker pods, by name, no slots."""
    text = "#!/bin/sh\n" + "".join(f"echo {pod.name}\n" for pod in sorted(pods, key=lambda p: p.name))
    fresh = path.with_suffix(".new")  # replaced whole: horovodrun runs it every second
    fresh.write_text(text)
    fresh.chmod(0o755)
    fresh.replace(path)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_elastic_job_loses_rank0s_host_and_grows_back(cluster, tmp_path, framework):
    """3 worker pods, --min-workers 2, tracked to an `mlflow server` pod. Rank 0's pod dies mid-epoch
    (every process in it killed) and leaves discover_hosts.sh; the job goes on with 2 ranks from
    the last commit before the kill, a new rank 0 writing the checkpoints and continuing the MLflow
    run. The pod restarts under its name and is listed again: after Horovod's blacklist cooldown it
    rejoins, and the job finishes with 3 ranks. Step counts prove that no committed step was lost
    or repeated at either change; Keras's reset lines show the LR following the world size."""
    from mlflow.tracking import MlflowClient

    from hvd_runtime.config import DataConfig
    from hvd_runtime.data import load_dataset
    from hvd_runtime.scaling import warmup_factor

    epochs, batch, commit_every, full = 20, 32, 5, 3
    project, job = generated_job(tmp_path, framework, "data", full, "--elastic", k8s_flags=("--root", "--min-workers", "2"),
                                 config={"epochs": epochs, "batch_size": batch, "elastic_commit_every": commit_every})
    n_train = len(load_dataset(DataConfig(), seed=42).train)

    def steps(samples: int, world: int) -> int:
        return math.ceil(math.ceil(samples / world) / batch)

    def steps_between(start: tuple[int, int], end: tuple[int, int], world: int) -> int:
        """Steps from (epoch, samples into it) to a later such position, at `world` ranks."""
        (e0, s0), (e1, s1) = start, end
        if e0 == e1:
            return (s1 - s0) // (world * batch)
        return steps(n_train - s0, world) + (e1 - e0 - 1) * steps(n_train, world) + s1 // (world * batch)

    stop_after = steps(n_train, full) + 2 * commit_every + 2   # early in epoch 2, 2 steps past a commit
    workers, launcher_pod, (mlflow_pod,), volume = worker_pods(cluster, project, job, extra_pods=("mlflow.default.svc",))
    store = cluster.base / "mlflow"
    store.mkdir()
    cluster.start(mlflow_pod, [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
                               f"sqlite:///{store / 'server.db'}", "--artifacts-destination", str(store / "artifacts"),
                               "--host", mlflow_pod.address, "--port", "5000", "--workers", "1"],
                  cluster.base / "mlflow.log", env=venv_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    cluster.wait_for_port(mlflow_pod, 5000, timeout=180)
    discovery = cluster.base / "discover_hosts.sh"
    write_discovery(discovery, workers)
    (tmp_path / "pacer").mkdir()
    (tmp_path / "pacer" / "sitecustomize.py").write_text(PACER)
    marker = tmp_path / "stopped"
    env = venv_env(PYTHONPATH=str(tmp_path / "pacer"), MLFLOW_TRACKING_URI=f"http://{mlflow_pod.address}:5000",
                   HVDT_MARKER=str(marker), HVDT_STOP_AFTER=str(stop_after), HVDT_FULL_SIZE=str(full),
                   HVDT_FRAMEWORK=framework)
    log = cluster.base / "launcher.log"
    launcher = cluster.start(launcher_pod, launcher_argv(job, discover_hosts=discovery), log, env=env)

    deadline = time.monotonic() + 300
    while not (marker.exists() and marker.read_text()) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), f"rank 0 never reached step {stop_after}:\n{log.read_text()[-4000:]}"
    # What rank 0 logged is sent by its tracking process, which the stop leaves running: the host is
    # lost once the first epoch's records have reached the server (records still in flight die with
    # it, and under load they can lag by more than the steps to the kill).
    delivered(store / "server.db", "epoch", 1, launcher, log)
    lost = next(pod for pod in workers if pod.name.split(".")[0] == marker.read_text())
    cluster.kill_pod(lost)                               # the host is gone ...
    write_discovery(discovery, [p for p in workers if p is not lost])   # ... and the operator lists it no more
    reset = (r"rank\(s\) now; continuing from the last commit: epoch (\d+), step (\d+), (\d+) samples"
             r"[^;\n]*(?:; lr (\S+))?")
    shrunk = wait_for_line(log, r"elastic reset: 2 " + reset, launcher)
    start_worker(cluster, job, lost)                     # the pod restarts under its name
    write_discovery(discovery, workers)
    grown = wait_for_line(log, r"elastic reset: 3 " + reset, launcher, timeout=240)
    assert launcher.wait(timeout=600) == 0, log.read_text()[-4000:]

    epoch, step, consumed = map(int, shrunk.groups()[:3])
    assert (epoch, step) == (1, stop_after // commit_every * commit_every), "not rolled back to the last commit"
    assert step == steps_between((0, 0), (epoch, consumed), full)
    grown_epoch, grown_step, grown_consumed = map(int, grown.groups()[:3])
    assert grown_step == step + steps_between((epoch, consumed), (grown_epoch, grown_consumed), full - 1), \
        "steps at 2 ranks were lost or repeated"
    final_step = grown_step + steps_between((grown_epoch, grown_consumed), (epochs, 0), full)
    if framework == "tensorflow":  # Keras shows the LR at a reset: it follows the world size, warmup included
        warmup = round(2.0 * steps(n_train, full))  # warmup_epochs x the steps of an epoch at the start
        for match, at, size in ((shrunk, step, 2), (grown, grown_step, 3)):
            assert float(match.group(4)) == pytest.approx(0.05 * size * warmup_factor(at, warmup, size), rel=1e-5)

    # One MLflow run holds the whole job: every epoch once, the world size at each change, finished.
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'server.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "epoch")
    assert sorted(int(m.value) for m in history) == list(range(1, epochs + 1)), "an epoch is missing from the run"
    assert max(m.step for m in history) == final_step, "a committed step was lost or repeated"
    sizes = sorted((m.step, int(m.value)) for m in client.get_metric_history(run.info.run_id, "world_size"))
    assert sizes == [(step, 2), (grown_step, 3)]
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == str(full)
    assert run.data.metrics["val_accuracy"] > 0.85
    # The checkpoints on the volume go on past the kill: written by the new rank 0.
    assert max(int(p.name.split("-")[1]) for p in volume.glob("ckpt-*")) == final_step   # folders of shards
