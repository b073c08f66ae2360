"""A generated project's MPIJob on the pods of tests/helpers/cluster.py, as the MPI Operator runs it.

Worker pods run the manifest's worker command (its sshd, with the job's key where
`sshAuthMountPath` says) and see their own copy of the project and the checkpoint volume where
the manifest mounts it; the launcher pod runs the launcher's command verbatim, against a hostfile
or a discover_hosts.sh written as the operator writes them (only their paths differ).
"""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from helpers.cluster import Cluster
from hvdgen.cli import main as cli
from hvdgen.k8s.kustomize import render


def generated_job(tmp_path: Path, framework: str, strategy: str, workers: int, *new_flags: str,
                  k8s_flags: tuple[str, ...] = ("--root",), config: dict[str, int] | None = None
                  ) -> tuple[Path, dict]:
    """A project and its CPU overlay's MPIJob (the GPU overlay's, given --gpus-per-worker), root
    unless `k8s_flags` leave out --root; `config`: settings of its config.yaml to change (default: 1 epoch)."""
    runner = CliRunner()
    result = runner.invoke(cli, ["new", "job", "-o", str(tmp_path), "--framework", framework, "--strategy", strategy,
                                 *new_flags])
    assert result.exit_code == 0, result.output
    project = tmp_path / "job"
    result = runner.invoke(cli, ["k8s", "--project", str(project), "--workers", str(workers), *k8s_flags])
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
    volume = cluster.volume("checkpoint-volume")  # the claim: one directory every worker mounts
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


def operator_env(job: dict, hostfile: Path) -> dict[str, str]:
    """What the operator sets on an OpenMPI job's launcher (mpi-operator's ompiEnvVars), the
    hostfile where this test put it: mpirun keeps the pods' full DNS names and retries ssh."""
    if job["spec"].get("mpiImplementation", "OpenMPI") != "OpenMPI":
        return {}
    return {"OMPI_MCA_orte_keep_fqdn_hostnames": "true", "OMPI_MCA_orte_default_hostfile": str(hostfile),
            "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}


def run_across_hosts(cluster: Cluster, project: Path, job: dict, env: dict) -> tuple[str, list, Path]:
    """Worker pods serving ssh as the manifest says, then the launcher's command in the launcher pod."""
    workers, launcher_pod, _, volume = worker_pods(cluster, project, job)
    hostfile = cluster.base / "hostfile"  # as the operator writes it for OpenMPI
    hostfile.write_text("".join(f"{pod.name} slots={job['spec']['slotsPerWorker']}\n" for pod in workers))
    argv = launcher_argv(job, hostfile=hostfile)
    proc = cluster.run(launcher_pod, argv, env={**env, **operator_env(job, hostfile)}, timeout=600)
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout, workers, volume
