"""Build a project's Kubeflow Trainer v2 job (trainer.kubeflow.org/v1alpha1) as plain data: a TrainJob
and the TrainingRuntime it runs on.

The Trainer ships MPI runtimes for DeepSpeed and MLX, none for Horovod, so hvdgen writes one per
project. How the Trainer's MPI plugin builds the pods (kubeflow/trainer v2.3,
pkg/runtime/framework/plugins/mpi and jobset) decides the shape:
- the runtime is a JobSet of two replicated jobs, `node` (the ranks' pods, serving sshd) and
  `launcher` (horovodrun), and both containers must be named `node`: the plugin mounts the job's
  SSH keys (at `mlPolicy.mpi.sshAuthMountPath`) and the launcher's hostfile
  (`/etc/mpi/hostfile`, one `<pod> slots=<numProcPerNode>` line per node) into containers of that
  name only;
- the TrainJob's `trainer` (image, command, args, env, resourcesPerNode) reaches only the replicated
  job labelled `trainer.kubeflow.org/trainjob-ancestor-step: trainer`, here the launcher; so the
  ranks' image and GPUs are the runtime's, and the TrainJob carries what a user changes per run:
  `numNodes`, `numProcPerNode` and the horovodrun line whose `-np` is their product;
- `runLauncherAsNode: false`: the launcher runs horovodrun and no sshd, so it must not be a host
  in the hostfile;
- the launcher `dependsOn` the nodes being Ready (their sshd accepts connections, the same TCP
  readiness probe as the MPIJob's workers), and the job succeeds when the launcher does;
- non-root only: the plugin mounts the private key with mode 0640, which ssh and sshd refuse as root
  (K8sOptions refuses --root with --api trainer);
- no elastic Horovod: a TrainJob's node count is fixed (K8sOptions refuses it).

Everything else (images, non-root security, MLflow URI source, NCCL environment, checkpoint claim,
resources) is the MPIJob's, from mpijob.py.
"""

from __future__ import annotations

from hvdgen.k8s.mpijob import (WORKDIR, container_security, default_gpu_image, default_image, environment,
                               labels, launch_args, launcher_resources, pod_security, ssh_path, worker_container,
                               worker_volumes)
from hvdgen.k8s.names import job_name
from hvdgen.k8s.options import K8sOptions
from hvdgen.k8s.ranks import slots_per_worker
from hvdgen.spec import ProjectSpec

API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINJOB = "TrainJob"
RUNTIME = "TrainingRuntime"
CLUSTER_RUNTIME = "ClusterTrainingRuntime"
RUNTIME_KINDS = (RUNTIME, CLUSTER_RUNTIME)
NODE = "node"  # the name of the ranks' replicated job, and of the container the plugin equips in both jobs
LAUNCHER = "launcher"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
ANCESTOR_TRAINER = "trainer"
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
# Set by the MPI plugin on the launcher; a TrainJob may not set them (the plugin's own validation).
RESERVED_ENV = ("OMPI_MCA_orte_default_hostfile", "OMPI_MCA_plm_rsh_args", "OMPI_MCA_orte_keep_fqdn_hostnames",
                "OMPI_MCA_orte_set_default_slots")
LAUNCHER_BACKOFF = 3  # horovodrun restarted in place up to 3 times, as the MPIJob's backoffLimit


def runtime_name(spec: ProjectSpec, opts: K8sOptions) -> str:
    return f"{job_name(spec.name, opts.workers, opts.api)}-horovod"


def _image(spec: ProjectSpec, opts: K8sOptions, gpu: bool) -> str:
    return default_gpu_image(spec, opts) if gpu else default_image(spec, opts)


def _node_job(spec: ProjectSpec, opts: K8sOptions, gpu: bool) -> dict:
    container = worker_container(spec, opts, gpu, _image(spec, opts, gpu), name=NODE)
    return {
        "name": NODE,
        "template": {"spec": {"template": {
            "metadata": {"labels": labels(spec, opts, NODE)},
            "spec": {"restartPolicy": "OnFailure", "containers": [container], "volumes": worker_volumes(spec, opts),
                     **pod_security(opts)},
        }}},
    }


def _launcher_job(spec: ProjectSpec, opts: K8sOptions, gpu: bool) -> dict:
    container = {"name": NODE, "image": _image(spec, opts, gpu), "workingDir": WORKDIR,
                 "env": environment(spec, opts, gpu), "resources": launcher_resources(), **container_security(opts)}
    return {
        "name": LAUNCHER,
        "dependsOn": [{"name": NODE, "status": "Ready"}],
        "template": {
            "metadata": {"labels": {ANCESTOR_LABEL: ANCESTOR_TRAINER}},
            "spec": {"backoffLimit": LAUNCHER_BACKOFF, "template": {
                "metadata": {"labels": labels(spec, opts, LAUNCHER)},
                "spec": {"restartPolicy": "OnFailure", "containers": [container], **pod_security(opts)},
            }},
        },
    }


def build_training_runtime(spec: ProjectSpec, opts: K8sOptions, gpu: bool = False) -> dict:
    """The project's Horovod runtime for the cpu (gpu=False) or gpu variant."""
    slots = slots_per_worker(spec, opts.gpus_per_worker if gpu else 0)
    return {
        "apiVersion": API_VERSION,
        "kind": RUNTIME,
        "metadata": {"name": runtime_name(spec, opts), "namespace": opts.namespace,
                     "labels": {**labels(spec, opts), FRAMEWORK_LABEL: "horovod"}},
        "spec": {
            "mlPolicy": {
                "numNodes": opts.workers,
                "mpi": {"numProcPerNode": slots, "mpiImplementation": "OpenMPI", "sshAuthMountPath": ssh_path(opts),
                        "runLauncherAsNode": False},
            },
            "template": {"spec": {
                # Pods resolve each other by name before they are Ready: horovodrun's ssh needs it.
                "network": {"publishNotReadyAddresses": True},
                # The nodes serve sshd until deleted; the job is done when horovodrun is.
                "successPolicy": {"operator": "All", "targetReplicatedJobs": [LAUNCHER]},
                "replicatedJobs": [_node_job(spec, opts, gpu), _launcher_job(spec, opts, gpu)],
            }},
        },
    }


def build_trainjob(spec: ProjectSpec, opts: K8sOptions, gpu: bool = False) -> dict:
    """The TrainJob: the runtime it runs on, its node count, ranks per node and the horovodrun line."""
    slots = slots_per_worker(spec, opts.gpus_per_worker if gpu else 0)
    return {
        "apiVersion": API_VERSION,
        "kind": TRAINJOB,
        "metadata": {"name": job_name(spec.name, opts.workers, opts.api), "namespace": opts.namespace,
                     "labels": labels(spec, opts)},
        "spec": {
            "runtimeRef": {"apiGroup": API_VERSION.split("/")[0], "kind": RUNTIME, "name": runtime_name(spec, opts)},
            "trainer": {
                "numNodes": opts.workers,
                "numProcPerNode": slots,
                "command": ["horovodrun"],
                "args": launch_args(opts, slots),
            },
        },
    }
