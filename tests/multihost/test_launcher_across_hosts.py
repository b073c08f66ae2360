"""A generated project's MPIJob, run across hosts as the MPI Operator runs it (tests/cluster.py).

Worker pods are network namespaces that run the manifest's worker command (its sshd, with the
job's key where `sshAuthMountPath` says) and see their own copy of the project and the checkpoint
volume where the manifest mounts it; the launcher pod runs the launcher's command verbatim,
against a hostfile written as the operator writes /etc/mpi/hostfile (only its path differs). So
`horovodrun` fans out over ssh to other addresses, Gloo finds the pods' interface, and rank 0's
outputs land on rank 0's pod and the shared volume, nowhere else.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cluster import Cluster, why_unavailable
from helpers import venv_env
from hvdgen.cli import main as cli
from hvdgen.k8s.kustomize import render

pytestmark = pytest.mark.slow

WORKSPACE_OUTPUTS = ("runs", "mlruns", "mlflow.db")  # what rank 0 writes beside the code


@pytest.fixture
def cluster(tmp_path):
    problem = why_unavailable()
    if problem:
        pytest.skip(f"Requires network namespaces and sshd: {problem}")
    made = Cluster(tmp_path / "cluster", tag=f"hvdt{os.getpid() % 10000}")
    try:
        yield made
    finally:
        made.down()


def generated_job(tmp_path: Path, framework: str, strategy: str, workers: int, *new_flags: str,
                  k8s_flags: tuple[str, ...] = (), config: dict[str, int] | None = None) -> tuple[Path, dict]:
    """A project with root manifests (the pods here run as root) and its CPU overlay's MPIJob;
    `config`: settings of its config.yaml to change (default: 1 epoch)."""
    runner = CliRunner()
    result = runner.invoke(cli, ["new", "job", "-o", str(tmp_path), "--framework", framework, "--strategy", strategy,
                                 *new_flags])
    assert result.exit_code == 0, result.output
    project = tmp_path / "job"
    result = runner.invoke(cli, ["k8s", "--project", str(project), "--root", "--workers", str(workers), *k8s_flags])
    assert result.exit_code == 0, result.output
    path = project / "config.yaml"
    text = path.read_text()
    for key, value in (config or {"epochs": 1}).items():
        text, found = re.subn(rf"^(  {key}:) \d+", rf"\g<1> {value}", text, count=1, flags=re.M)
        assert found, f"config.yaml has no {key}"
    path.write_text(text)
    overlay = "gpu" if "--gpus-per-worker" in k8s_flags else "cpu"
    job = next(o for o in render(project / "k8s" / "overlays" / overlay) if o["kind"] == "MPIJob")
    return project, job


def container(job: dict, role: str) -> dict:
    """The MPIJob's Launcher or Worker container: its command, args, mounts."""
    return job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"][0]


def worker_pods(cluster: Cluster, project: Path, job: dict, extra_pods: tuple[str, ...] = ()):
    """The job's worker pods serving ssh as the manifest says, the launcher pod, and any
    `extra_pods` (services the job uses); the checkpoint volume they mount."""
    spec = job["spec"]
    worker = container(job, "Worker")
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    cluster.up(project, spec["sshAuthMountPath"])
    volume = cluster.base / "checkpoint-volume"  # the claim: one directory every worker mounts
    volume.mkdir()
    workdir = Path(worker["workingDir"])
    mounts = {str(Path(m["mountPath"]).relative_to(workdir)): volume
              for m in worker["volumeMounts"] if m["name"] == "checkpoints"}
    workers = [cluster.add_pod(f"{name}-worker-{i}.{name}-worker.{namespace}.svc", volumes=mounts)
               for i in range(spec["mpiReplicaSpecs"]["Worker"]["replicas"])]
    launcher_pod = cluster.add_pod(f"{name}-launcher.{name}-worker.{namespace}.svc")
    extras = [cluster.add_pod(extra) for extra in extra_pods]
    for pod in workers:
        start_worker(cluster, job, pod)
    return workers, launcher_pod, extras, volume


def start_worker(cluster: Cluster, job: dict, pod) -> None:
    """The manifest's worker command (its sshd) in `pod`, once it listens."""
    worker = container(job, "Worker")
    cluster.start(pod, worker["command"] + worker["args"], cluster.base / f"{pod.name}.log")
    cluster.wait_for_port(pod, int(worker["args"][worker["args"].index("-p") + 1]))


def launcher_argv(job: dict, **paths: Path) -> list[str]:
    """The launcher's command verbatim, but for where the operator's files are (hostfile=, discover_hosts=)."""
    launcher = container(job, "Launcher")
    places = {"/etc/mpi/hostfile": paths.get("hostfile"), "/etc/mpi/discover_hosts.sh": paths.get("discover_hosts")}
    return [str(places.get(arg) or arg) for arg in launcher["command"] + launcher["args"]]


def run_across_hosts(cluster: Cluster, project: Path, job: dict, env: dict) -> tuple[str, list, Path]:
    """Worker pods serving ssh as the manifest says, then the launcher's command in the launcher pod."""
    workers, launcher_pod, _, volume = worker_pods(cluster, project, job)
    hostfile = cluster.base / "hostfile"  # as the operator writes it for OpenMPI
    hostfile.write_text("".join(f"{pod.name} slots={job['spec']['slotsPerWorker']}\n" for pod in workers))
    argv = launcher_argv(job, hostfile=hostfile)
    proc = cluster.run(launcher_pod, argv, env=env, timeout=600)
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout, workers, volume


DIGESTS = '''\
"""sitecustomize for the multi-host jobs' ranks (on PYTHONPATH, which horovodrun passes to every rank).

Each rank writes a digest of its weights to HVDT_DIGESTS/<part>-rank<N> whenever the job
checkpoints (every rank takes part in that, only rank 0 writes the file): `model` for data
parallel, `stage<S>` for a pipeline's stage, so the test can compare ranks on different hosts.
"""
import hashlib, os
from pathlib import Path

if os.environ.get("HOROVOD_HOSTNAME"):
    import numpy as np

    out, rank = Path(os.environ["HVDT_DIGESTS"]), int(os.environ["HOROVOD_RANK"])

    def record(part, arrays):
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()
        (out / f"{part}-rank{rank}").write_text(digest)

    def after(save, part_of, weights_of):
        def recording_save(*args):
            saved = save(*args)     # after: buffers are averaged as part of the save
            record(part_of(*args), weights_of(*args))
            return saved
        return recording_save

    if os.environ["HVDT_FRAMEWORK"] == "torch":
        import hvd_runtime.torch as package
        import hvd_runtime.torch.pipeline_state as pipeline
        import hvd_runtime.torch.state as state

        def torch_weights(store, module, *rest):
            return [t.detach().cpu().numpy() for t in module.state_dict().values()]

        state.save_checkpoint = package.save_checkpoint = after(
            state.save_checkpoint, lambda *args: "model", torch_weights)
        pipeline.save_pipeline_checkpoint = after(
            pipeline.save_pipeline_checkpoint, lambda *args: f"stage{args[-1].dims.coords(rank)[0]}", torch_weights)
    else:
        import hvd_runtime.tf as package
        import hvd_runtime.tf.state as state

        state.save_checkpoint = package.save_checkpoint = after(
            state.save_checkpoint, lambda *args: "model", lambda store, model, *rest: model.get_weights())
'''


@pytest.mark.parametrize("framework, strategy", [("torch", "data"), ("tensorflow", "data"), ("torch", "pipeline")],
                         ids=["torch-data", "tensorflow-data", "torch-pipeline-2x2"])
def test_job_trains_across_worker_pods(cluster, tmp_path, framework, strategy):
    """2 worker pods x 2 slots (the GPU overlay's MPIJob, 2 GPUs a worker, run on CPU ranks): data
    parallel over 4 ranks, or a 2-stage pipeline with 2 replicas. Ranks on different pods end
    with the same weights; rank 0's pod and the volume hold every output, the others none."""
    project, job = generated_job(tmp_path, framework, strategy, 2, k8s_flags=("--gpus-per-worker", "2"))
    assert job["spec"]["slotsPerWorker"] == 2
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(DIGESTS)
    digests = tmp_path / "digests"
    digests.mkdir()
    out, worker_pods, volume = run_across_hosts(cluster, project, job, env=venv_env(
        PYTHONPATH=str(tmp_path / "hooks"), HVDT_DIGESTS=str(digests), HVDT_FRAMEWORK=framework))
    started = "pipeline of 2 stages x 2 replica(s)" if strategy == "pipeline" else "training on 4 rank(s)"
    assert started in out, out[-3000:]
    assert re.search(r"epoch\s+1\b.*val_accuracy", out), out[-3000:]
    parts = {}
    for path in digests.iterdir():
        part, rank = path.name.rsplit("-rank", 1)
        parts.setdefault(part, {})[int(rank)] = path.read_text()
    expected = {"stage0": [0, 2], "stage1": [1, 3]} if strategy == "pipeline" else {"model": [0, 1, 2, 3]}
    assert {part: sorted(ranks) for part, ranks in parts.items()} == expected  # rank r on pod r // 2
    for part, ranks in parts.items():
        assert len(set(ranks.values())) == 1, f"the ranks' {part} weights differ across pods: {ranks}"
    rank0, launcher = worker_pods[0], cluster.pods[-1]
    assert all((rank0.files / "workspace" / name).exists() for name in WORKSPACE_OUTPUTS), \
        sorted(os.listdir(rank0.files / "workspace"))
    for pod in [*worker_pods[1:], launcher]:  # the other workers and the launcher write nothing
        written = [n for n in (*WORKSPACE_OUTPUTS, "checkpoints") if (pod.files / "workspace" / n).exists()
                   and (n != "checkpoints" or any((pod.files / "workspace" / n).iterdir()))]
        assert not written, f"{pod.name} wrote {written}"
    assert [p.suffix for p in volume.iterdir()] == [".pt" if framework == "torch" else ".pkl"], \
        "rank 0's checkpoint is not (alone) on the checkpoint volume"


def test_a_host_the_launcher_cannot_use_ends_the_job_in_one_line(cluster, tmp_path):
    """A hostfile naming a host that does not resolve, one without sshd, or one that refuses the
    job's key: the launcher names the host and the problem, ends in one line, exit 1, within the
    time ssh's retries take, and leaves nothing running."""
    project, job = generated_job(tmp_path, "torch", "data", workers=2)
    worker = container(job, "Worker")
    cluster.up(project, job["spec"]["sshAuthMountPath"])
    good, no_sshd, other_key = (cluster.add_pod(f"job-worker-{i}.job-worker.default.svc") for i in range(3))
    launcher_pod = cluster.add_pod("job-launcher.job-worker.default.svc")
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(stranger)], check=True)
    port = int(worker["args"][worker["args"].index("-p") + 1])
    cluster.start(good, worker["command"] + worker["args"], tmp_path / "good.log")
    cluster.start(other_key, worker["command"] + worker["args"] + ["-o", f"AuthorizedKeysFile={stranger}.pub"],
                  tmp_path / "other-key.log")
    for pod in (good, other_key):
        cluster.wait_for_port(pod, port)
    env = venv_env()
    hostfile = tmp_path / "hostfile"
    argv = launcher_argv(job, hostfile=hostfile)
    for host, problem in (("job-worker-7.job-worker.default.svc", "Could not resolve hostname"),
                          (no_sshd.name, "Connection refused"), (other_key.name, "Permission denied")):
        hostfile.write_text(f"{good.name} slots=1\n{host} slots=1\n")
        proc = cluster.run(launcher_pod, argv, env=env, timeout=300)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
        assert f"ssh not successful for host {host}" in output and problem in output, output[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == "horovodrun: error: could not connect to some hosts via ssh"
        assert not subprocess.run(["ip", "netns", "pids", launcher_pod.netns], capture_output=True,
                                  text=True).stdout.split(), "the launcher left processes running"


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
    or repeated at either change."""
    from mlflow.tracking import MlflowClient

    from hvd_runtime.config import DataConfig
    from hvd_runtime.data import load_dataset

    epochs, batch, commit_every, full = 20, 32, 5, 3
    project, job = generated_job(tmp_path, framework, "data", full, "--elastic", k8s_flags=("--min-workers", "2"),
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
    lost = next(pod for pod in workers if pod.name.split(".")[0] == marker.read_text())
    cluster.kill_pod(lost)                               # the host is gone ...
    write_discovery(discovery, [p for p in workers if p is not lost])   # ... and the operator lists it no more
    shrunk = wait_for_line(log, r"elastic reset: 2 rank\(s\) now; continuing from the last commit: "
                                r"epoch (\d+), step (\d+), (\d+) samples", launcher)
    start_worker(cluster, job, lost)                     # the pod restarts under its name
    write_discovery(discovery, workers)
    grown = wait_for_line(log, r"elastic reset: 3 rank\(s\) now; continuing from the last commit: "
                               r"epoch (\d+), step (\d+), (\d+) samples", launcher, timeout=240)
    assert launcher.wait(timeout=600) == 0, log.read_text()[-4000:]

    epoch, step, consumed = map(int, shrunk.groups())
    assert (epoch, step) == (1, stop_after // commit_every * commit_every), "not rolled back to the last commit"
    assert step == steps_between((0, 0), (epoch, consumed), full)
    grown_epoch, grown_step, grown_consumed = map(int, grown.groups())
    assert grown_step == step + steps_between((epoch, consumed), (grown_epoch, grown_consumed), full - 1), \
        "steps at 2 ranks were lost or repeated"
    final_step = grown_step + steps_between((grown_epoch, grown_consumed), (epochs, 0), full)

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
    suffix = "pt" if framework == "torch" else "pkl"
    assert max(int(p.stem.split("-")[1]) for p in volume.glob(f"ckpt-*.{suffix}")) == final_step
