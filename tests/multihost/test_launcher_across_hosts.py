"""A generated project's MPIJob, run across hosts as the MPI Operator runs it (tests/helpers/mpijob_pods.py).

`horovodrun` fans out over ssh to other addresses, Gloo finds the pods' interface, the ranks on
different pods agree, and rank 0's outputs land on rank 0's pod and the shared volume, nowhere
else; a host the launcher cannot use ends the job in one line.

Cost: over 6% of the suite's CPU (docs/testing.md): every rank runs in a pod's network namespace,
reached over ssh (or mpirun), so none starts warm (tests/warm_start serves this host's namespace
only).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from helpers import venv_env
from helpers.mpijob_pods import container, generated_job, launcher_argv, run_across_hosts

pytestmark = pytest.mark.slow

WORKSPACE_OUTPUTS = ("runs", "mlruns", "mlflow.db")  # what rank 0 writes beside the code


DIGESTS = '''\
"""sitecustomize for the multi-host jobs' ranks (on PYTHONPATH, which horovodrun passes to every rank,
with Gloo or through mpirun, and srun with its job's environment; horovodrun itself and its
helpers have no rank and record nothing).

Each rank writes a digest of its weights to HVDT_DIGESTS/<part>-rank<N> whenever the job
checkpoints (every rank takes part in that): `model` for data parallel, `stage<S>` for a
pipeline's stage, so the test can compare ranks on different hosts.
"""
import hashlib, os
from pathlib import Path

RANK = os.environ.get("HOROVOD_RANK") if os.environ.get("HOROVOD_HOSTNAME") else \
    os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK"))  # mpirun's, or srun --mpi=pmix's
if RANK is not None:
    import numpy as np

    out, rank = Path(os.environ["HVDT_DIGESTS"]), int(RANK)

    def record(part, arrays):
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()
        (out / f"{part}-rank{rank}").write_text(digest)

    def after(save, part_of, weights_of):
        def recording_save(*args, **kwargs):
            saved = save(*args, **kwargs)     # after: buffers are averaged as part of the save
            record(part_of(*args), weights_of(*args))
            return saved
        return recording_save

    if os.environ["HVDT_FRAMEWORK"] == "torch":
        import hvd_runtime.torch as package
        import hvd_runtime.torch.checkpoint as checkpoint

        def torch_weights(store, parallel, *rest):
            return [t.detach().cpu().numpy() for t in parallel.module.state_dict().values()]

        def torch_part(store, parallel, state, ctx):
            return "model" if ctx.coords is None else f"stage{ctx.coords.pp}"

        checkpoint.save_checkpoint = package.save_checkpoint = after(checkpoint.save_checkpoint, torch_part,
                                                                     torch_weights)
    else:
        import hvd_runtime.tf as package
        import hvd_runtime.tf.checkpoint as checkpoint

        checkpoint.save_checkpoint = package.save_checkpoint = after(
            checkpoint.save_checkpoint, lambda *args: "model",
            lambda store, parallel, *rest: parallel.module.get_weights())
'''


def mpi_missing() -> str | None:
    """Why the MPI controller cannot run here, or None."""
    from horovod.common.util import mpi_built

    if not shutil.which("mpirun"):
        return "no mpirun (scripts/setup.sh installs openmpi-bin where it may)"
    return None if mpi_built() else "this Horovod was built without MPI (no mpicxx when it was built)"


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@pytest.mark.parametrize("framework, strategy", [("torch", "data"), ("tensorflow", "data"), ("torch", "pipeline")],
                         ids=["torch-data", "tensorflow-data", "torch-pipeline-2x2"])
def test_job_trains_across_worker_pods(cluster, tmp_path, framework, strategy, controller):
    """2 worker pods x 2 slots (the GPU overlay's MPIJob, 2 GPUs a worker, run on CPU ranks): data
    parallel over 4 ranks, or a 2-stage pipeline with 2 replicas, with Gloo or with OpenMPI
    (mpirun over the operator's ssh). Ranks on different pods end with the same weights; rank 0's
    pod and the volume hold every output, the others none. The torch data-parallel jobs run as
    generated, non-root (the images' mpiuser); the others as root (`hvdgen k8s --root`)."""
    if controller == "mpi" and mpi_missing():
        pytest.skip(f"Requires: Horovod with MPI: {mpi_missing()}")
    user = () if (framework, strategy) == ("torch", "data") else ("--root",)
    project, job = generated_job(tmp_path, framework, strategy, 2,
                                 k8s_flags=(*user, "--gpus-per-worker", "2", "--controller", controller))
    assert job["spec"]["slotsPerWorker"] == 2 and f"--{controller}" in container(job, "Launcher")["args"]
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(DIGESTS)
    digests = tmp_path / "digests"
    digests.mkdir()
    digests.chmod(0o777)  # the ranks may run as mpiuser
    out, worker_pods, volume = run_across_hosts(cluster, project, job, env=venv_env(
        PYTHONPATH=str(tmp_path / "hooks"), HVDT_DIGESTS=str(digests), HVDT_FRAMEWORK=framework))
    started = "pipeline of 2 stages x 2 replica(s)" if strategy == "pipeline" else "training on 4 rank(s)"
    assert started in out, out[-3000:]
    # Gloo tags a rank's lines [rank]<stdout>:, mpirun --tag-output [job,rank]<stdout>:
    tag = r"\[\d+,0\]<stdout>:" if controller == "mpi" else r"\[0\]<stdout>:"
    assert re.match(tag, out), f"rank 0's lines are not in the form {controller} prints: {out[-2000:]}"
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
    # a folder: one shard from each rank of the first replica (rank 0 alone in data)
    [saved] = volume.iterdir()
    shards = {"rank-00000.safetensors", "rank-00001.safetensors"} if strategy == "pipeline" \
        else {"rank-00000.safetensors"}
    assert {p.name for p in saved.iterdir()} == {"index.json", *shards}, "not the checkpoint's shards alone"
    written = [volume, *volume.rglob("*")]
    assert {p.stat().st_uid for p in written[1:]} == {0 if user else 1000}, "not written as the job's user"


def test_pipeline_stages_link_across_hosts_that_name_themselves_on_loopback(cluster, tmp_path):
    """A pipeline's stages on different hosts whose /etc/hosts name themselves on 127.0.1.1, as
    Debian and Ubuntu write it on a workstation, launched with MPI (the CPU overlay: a stage per
    pod). Each stage's link must listen on an address its neighbour on the other host reaches,
    not on what the host's own name resolves to."""
    if mpi_missing():
        pytest.skip(f"Requires: Horovod with MPI: {mpi_missing()}")
    project, job = generated_job(tmp_path, "torch", "pipeline", 2, k8s_flags=("--root", "--controller", "mpi"))
    assert job["spec"]["slotsPerWorker"] == 1
    cluster.own_name_on_loopback = True
    out, worker_pods, volume = run_across_hosts(cluster, project, job, env=venv_env())
    assert "pipeline of 2 stages x 1 replica(s)" in out and re.search(r"epoch\s+1\b.*val_accuracy", out), out[-3000:]
    [saved] = volume.iterdir()   # each stage's rank wrote its shard onto the shared volume
    assert {p.name for p in saved.iterdir()} == {"index.json", "rank-00000.safetensors", "rank-00001.safetensors"}


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
