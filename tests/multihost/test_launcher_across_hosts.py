"""A generated project's MPIJob, run across hosts as the MPI Operator runs it (tests/cluster.py).

Worker pods are network namespaces that run the manifest's worker command (its sshd, with the
job's key where `sshAuthMountPath` says) and see their own copy of the project and the checkpoint
volume where the manifest mounts it; the launcher pod runs the launcher's command verbatim,
against a hostfile written as the operator writes /etc/mpi/hostfile (only its path differs). So
`horovodrun` fans out over ssh to other addresses, Gloo finds the pods' interface, and rank 0's
outputs land on rank 0's pod and the shared volume, nowhere else.
"""

from __future__ import annotations

import os
import re
import subprocess
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


def generated_job(tmp_path: Path, framework: str, strategy: str, workers: int) -> tuple[Path, dict]:
    """A project with root manifests (the pods here run as root) and its CPU overlay's MPIJob."""
    runner = CliRunner()
    result = runner.invoke(cli, ["new", "job", "-o", str(tmp_path), "--framework", framework, "--strategy", strategy])
    assert result.exit_code == 0, result.output
    project = tmp_path / "job"
    result = runner.invoke(cli, ["k8s", "--project", str(project), "--root", "--workers", str(workers)])
    assert result.exit_code == 0, result.output
    config = project / "config.yaml"
    config.write_text(re.sub(r"^  epochs: \d+", "  epochs: 1", config.read_text(), count=1, flags=re.M))
    job = next(o for o in render(project / "k8s" / "overlays" / "cpu") if o["kind"] == "MPIJob")
    return project, job


def container(job: dict, role: str) -> dict:
    """The MPIJob's Launcher or Worker container: its command, args, mounts."""
    return job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"][0]


def run_across_hosts(cluster: Cluster, project: Path, job: dict) -> tuple[str, list, Path]:
    """Worker pods serving ssh as the manifest says, then the launcher's command in the launcher pod."""
    spec = job["spec"]
    replicas = spec["mpiReplicaSpecs"]
    worker, launcher = container(job, "Worker"), container(job, "Launcher")
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    cluster.up(project, spec["sshAuthMountPath"])
    volume = cluster.base / "checkpoint-volume"  # the claim: one directory every worker mounts
    volume.mkdir()
    workdir = Path(worker["workingDir"])
    mounts = {str(Path(m["mountPath"]).relative_to(workdir)): volume
              for m in worker["volumeMounts"] if m["name"] == "checkpoints"}
    workers = [cluster.add_pod(f"{name}-worker-{i}.{name}.{namespace}.svc", volumes=mounts)
               for i in range(replicas["Worker"]["replicas"])]
    launcher_pod = cluster.add_pod(f"{name}-launcher.{name}.{namespace}.svc")
    port = int(worker["args"][worker["args"].index("-p") + 1])
    for pod in workers:
        cluster.start(pod, worker["command"] + worker["args"], cluster.base / f"{pod.name}.log")
    for pod in workers:
        cluster.wait_for_port(pod, port)
    hostfile = cluster.base / "hostfile"  # as the operator writes it for OpenMPI
    hostfile.write_text("".join(f"{pod.name} slots={spec['slotsPerWorker']}\n" for pod in workers))
    argv = [arg.replace("/etc/mpi/hostfile", str(hostfile)) for arg in launcher["command"] + launcher["args"]]
    env = venv_env()
    proc = cluster.run(launcher_pod, argv, env=env, timeout=600)
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout, workers, volume


@pytest.mark.parametrize("framework, strategy, workers", [
    ("torch", "data", 2), ("tensorflow", "data", 2), ("torch", "pipeline", 4)],
    ids=["torch-data", "tensorflow-data", "torch-pipeline-2x2"])
def test_job_trains_across_worker_pods(cluster, tmp_path, framework, strategy, workers):
    """Data parallel over 2 pods; a 2-stage pipeline with 2 replicas over 4 pods (a rank each)."""
    project, job = generated_job(tmp_path, framework, strategy, workers=workers)
    out, worker_pods, volume = run_across_hosts(cluster, project, job)
    world = job["spec"]["slotsPerWorker"] * len(worker_pods)
    started = ("pipeline of 2 stages x 2 replica(s)" if strategy == "pipeline" else f"training on {world} rank(s)")
    assert started in out, out[-3000:]
    assert re.search(r"epoch\s+1\b.*val_accuracy", out), out[-3000:]
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
    worker, launcher = container(job, "Worker"), container(job, "Launcher")
    cluster.up(project, job["spec"]["sshAuthMountPath"])
    good, no_sshd, other_key = (cluster.add_pod(f"job-worker-{i}.job.default.svc") for i in range(3))
    launcher_pod = cluster.add_pod("job-launcher.job.default.svc")
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
    argv = [arg.replace("/etc/mpi/hostfile", str(hostfile)) for arg in launcher["command"] + launcher["args"]]
    for host, problem in (("job-worker-7.job.default.svc", "Could not resolve hostname"),
                          (no_sshd.name, "Connection refused"), (other_key.name, "Permission denied")):
        hostfile.write_text(f"{good.name} slots=1\n{host} slots=1\n")
        proc = cluster.run(launcher_pod, argv, env=env, timeout=300)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
        assert f"ssh not successful for host {host}" in output and problem in output, output[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == "horovodrun: error: could not connect to some hosts via ssh"
        assert not subprocess.run(["ip", "netns", "pids", launcher_pod.netns], capture_output=True,
                                  text=True).stdout.split(), "the launcher left processes running"
