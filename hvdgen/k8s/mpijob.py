"""Build the MPIJob (kubeflow.org/v2beta1) of a project as plain data, one function per part.

Choices that users otherwise learn the hard way:
- `launcherCreationPolicy: WaitForWorkersReady` plus a TCP readiness probe on sshd, so the launcher
  starts only when every worker accepts SSH (not merely when its container started);
- GPUs in the workers' `limits` only; the launcher runs no rank and gets none;
- `slotsPerWorker` = ranks per worker: one per GPU (1 on CPU), except model-split, whose ranks each
  spread their stages over GPUs of their own (see ranks.py); `-np` = workers x slots;
- non-root pods by default (uid 1000, the images' `mpiuser`, no privilege escalation, no
  capabilities, the runtime's seccomp profile: the Pod Security Standards' "restricted" level);
  root only when asked for, since the images' USER is mpiuser;
- the MLflow URI from a ConfigMap or Secret, `optional` so a job without one logs locally;
- checkpoints on a PersistentVolumeClaim mounted where the project's config writes them, so a
  restarted launcher resumes instead of starting over.
"""

from __future__ import annotations

from hvdgen.k8s.launch import horovodrun_args
from hvdgen.k8s.names import job_name
from hvdgen.k8s.options import K8sOptions
from hvdgen.k8s.ranks import slots_per_worker
from hvdgen.spec import ProjectSpec

API_VERSION = "kubeflow.org/v2beta1"
KIND = "MPIJob"
WORKDIR = "/workspace"  # where the Dockerfiles put the project
CHECKPOINT_DIR = f"{WORKDIR}/checkpoints"  # the project's config writes checkpoints/ under its working dir
SSH_PORT = 2222  # the images' sshd listens here: above 1024, so it also works as a non-root user
ROOT_SSH_PATH = "/root/.ssh"
NON_ROOT_SSH_PATH = "/home/mpiuser/.ssh"
NON_ROOT_UID = 1000  # the images' mpiuser
STAGES_LABEL = "hvdgen/stages"  # on model-split and pipeline jobs, for `hvdgen k8s --check`
TP_LABEL = "hvdgen/tp"  # on tensor-parallel jobs, for `hvdgen k8s --check`
GPU_RESOURCE = "nvidia.com/gpu"
NCCL_ENV = {
    "NCCL_DEBUG": "WARN",  # INFO prints the ring/tree set-up: use it when NCCL hangs
    "NCCL_SOCKET_IFNAME": "^lo,docker",  # any interface but loopback and docker bridges
}


def default_image(spec: ProjectSpec, opts: K8sOptions) -> str:
    return opts.image or f"{job_name(spec.name, opts.workers, opts.api)}:latest"


def default_gpu_image(spec: ProjectSpec, opts: K8sOptions) -> str:
    if opts.gpu_image:
        return opts.gpu_image
    image = default_image(spec, opts)
    repo, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    return f"{repo}:{tag}-cuda"


def labels(spec: ProjectSpec, opts: K8sOptions, component: str | None = None) -> dict:
    out = {"app.kubernetes.io/name": job_name(spec.name, opts.workers, opts.api),
           "app.kubernetes.io/managed-by": "hvdgen",
           "hvdgen/framework": spec.framework,
           "hvdgen/strategy": spec.strategy}
    if spec.strategy in ("model-split", "pipeline"):
        out[STAGES_LABEL] = str(spec.stages)
    if spec.tp > 1:  # tensor, or a pipeline of tensor-parallel stages
        out[TP_LABEL] = str(spec.tp)
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def checkpoint_claim_name(spec: ProjectSpec, opts: K8sOptions) -> str:
    return f"{job_name(spec.name, opts.workers, opts.api)}-checkpoints"


def mlflow_source_name(spec: ProjectSpec, opts: K8sOptions) -> str:
    return f"{job_name(spec.name, opts.workers, opts.api)}-mlflow"


def environment(spec: ProjectSpec, opts: K8sOptions, gpu: bool) -> list[dict]:
    """Set on the launcher, which horovodrun forwards to every rank, and on the workers alike."""
    ref_kind = "configMapKeyRef" if opts.mlflow_uri_from == "configmap" else "secretKeyRef"
    env = [
        {"name": "MLFLOW_TRACKING_URI", "valueFrom": {ref_kind: {
            "name": mlflow_source_name(spec, opts), "key": "MLFLOW_TRACKING_URI", "optional": True}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if gpu:
        env += [{"name": key, "value": value} for key, value in NCCL_ENV.items()]
    return env


def container_security(opts: K8sOptions) -> dict:
    """Non-root containers keep no capability and cannot regain privileges (sshd on port 2222 needs none)."""
    if not opts.non_root:
        return {}
    return {"securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}


def pod_security(opts: K8sOptions) -> dict:
    """Who the pod's processes run as. fsGroup makes the checkpoint volume writable for the non-root user;
    root must be named because the images' USER is mpiuser."""
    if opts.non_root:
        return {"securityContext": {"runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID, "runAsNonRoot": True,
                                    "fsGroup": NON_ROOT_UID, "seccompProfile": {"type": "RuntimeDefault"}}}
    return {"securityContext": {"runAsUser": 0, "runAsGroup": 0}}


def ssh_path(opts: K8sOptions) -> str:
    return NON_ROOT_SSH_PATH if opts.non_root else ROOT_SSH_PATH


def launch_args(opts: K8sOptions, slots: int) -> list[str]:
    """horovodrun's arguments for this job: every slot of every worker runs one rank."""
    return horovodrun_args(opts.workers, slots, opts.elastic, opts.min_np_workers, opts.max_np_workers,
                           opts.controller)


def launcher_resources() -> dict:
    """The launcher only runs horovodrun; the ranks run on the workers."""
    return {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}


def launcher_container(spec: ProjectSpec, opts: K8sOptions, gpu: bool, image: str, slots: int) -> dict:
    return {
        "name": "launcher",
        "image": image,
        "workingDir": WORKDIR,
        "command": ["horovodrun"],
        "args": launch_args(opts, slots),
        "env": environment(spec, opts, gpu),
        "resources": launcher_resources(),
        **container_security(opts),
    }


def worker_resources(gpus: int) -> dict:
    if not gpus:
        return {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    # Extended resources such as GPUs belong in limits; Kubernetes copies them to requests.
    return {"requests": {"cpu": str(4 * gpus), "memory": f"{16 * gpus}Gi"},
            "limits": {"memory": f"{16 * gpus}Gi", GPU_RESOURCE: gpus}}


def worker_container(spec: ProjectSpec, opts: K8sOptions, gpu: bool, image: str, name: str = "worker") -> dict:
    return {
        "name": name,
        "image": image,
        "workingDir": WORKDIR,
        # Workers only serve SSH; the host key is the job's key, mounted by the operator, so no
        # key is ever baked into the image.
        "command": ["/usr/sbin/sshd"],
        "args": ["-D", "-e", "-p", str(SSH_PORT), "-h", f"{ssh_path(opts)}/id_rsa"],
        "ports": [{"name": "ssh", "containerPort": SSH_PORT}],
        "readinessProbe": {"tcpSocket": {"port": SSH_PORT}, "periodSeconds": 2, "failureThreshold": 30},
        "env": environment(spec, opts, gpu),
        "resources": worker_resources(opts.gpus_per_worker if gpu else 0),
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        **container_security(opts),
    }


def worker_volumes(spec: ProjectSpec, opts: K8sOptions) -> list[dict]:
    return [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_claim_name(spec, opts)}},
        # Docker's default 64 MiB /dev/shm is too small for NCCL and DataLoader workers.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    ]


def build_mpijob(spec: ProjectSpec, opts: K8sOptions, gpu: bool = False) -> dict:
    """The whole MPIJob for the cpu (gpu=False) or gpu variant."""
    name = job_name(spec.name, opts.workers, opts.api)
    slots = slots_per_worker(spec, opts.gpus_per_worker if gpu else 0)
    image = default_gpu_image(spec, opts) if gpu else default_image(spec, opts)
    run_policy = {"cleanPodPolicy": "Running", "backoffLimit": 3}
    if opts.elastic:
        # Gang-schedule only the launcher and the fewest workers the job can run with.
        run_policy["schedulingPolicy"] = {"minAvailable": opts.min_np_workers + 1}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": opts.namespace, "labels": labels(spec, opts)},
        "spec": {
            "slotsPerWorker": slots,
            "launcherCreationPolicy": "WaitForWorkersReady",
            "mpiImplementation": "OpenMPI",
            "sshAuthMountPath": ssh_path(opts),
            "runPolicy": run_policy,
            "mpiReplicaSpecs": {
                "Launcher": {
                    "replicas": 1,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "metadata": {"labels": labels(spec, opts, "launcher")},
                        "spec": {"containers": [launcher_container(spec, opts, gpu, image, slots)],
                                 **pod_security(opts)},
                    },
                },
                "Worker": {
                    "replicas": opts.workers,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "metadata": {"labels": labels(spec, opts, "worker")},
                        "spec": {"containers": [worker_container(spec, opts, gpu, image)],
                                 "volumes": worker_volumes(spec, opts), **pod_security(opts)},
                    },
                },
            },
        },
    }


def build_checkpoint_claim(spec: ProjectSpec, opts: K8sOptions) -> dict:
    """ReadWriteMany because every worker mounts it (rank 0 writes; all ranks may read on resume)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": checkpoint_claim_name(spec, opts), "namespace": opts.namespace,
                     "labels": labels(spec, opts)},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": opts.checkpoint_size}}},
    }
