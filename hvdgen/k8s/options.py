"""The Kubernetes answers of a project: what `hvdgen k8s` asks, checked before any manifest is built.

Kept in `.hvdgen.yaml` under `k8s:` (hvdgen/answers.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hvdgen.answers import Answers, flag
from hvdgen.errors import HvdgenError
from hvdgen.k8s.limits import MAX_CLAIM, MAX_GPUS_PER_POD, MAX_WORKERS, MIN_CLAIM, parse_quantity

# A container image reference: [registry[:port]/]path[:tag][@digest], lower-case path.
_IMAGE = re.compile(r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]{1,2}[a-z0-9]+)*)*"
                    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MLFLOW_SOURCES = ("configmap", "secret")
CONTROLLERS = ("gloo", "mpi")  # how horovodrun starts and coordinates the ranks; both are in the images
APIS = ("mpijob", "trainer")  # the MPI operator's MPIJob (kubeflow.org/v2beta1), or Kubeflow Trainer v2's TrainJob
# Counts: (answer, smallest, largest, example); 0 for min/max workers means "the default".
_RANGES = (("workers", 1, MAX_WORKERS, 2), ("gpus_per_worker", 0, MAX_GPUS_PER_POD, 1),
           ("min_workers", 0, MAX_WORKERS, 1), ("max_workers", 0, MAX_WORKERS, 4))


@dataclass(frozen=True)
class K8sOptions(Answers):
    """One MPIJob's shape. Defaults give a 2-worker CPU job and a 1-GPU-per-worker GPU overlay."""

    RANGES = _RANGES
    SECTION = "k8s"
    EXAMPLES = {"image": "registry.example.com/team/demo:v1", "gpu_image": "registry.example.com/team/demo:v1-cuda"}

    workers: int = 2
    gpus_per_worker: int = 1  # GPUs per worker in the gpu overlay; 0 leaves the gpu overlay out
    image: str = ""  # CPU image; empty means "<job name>:latest"
    gpu_image: str = ""  # CUDA image; empty means the CPU image's tag with "-cuda" appended
    namespace: str = "default"
    elastic: bool = False
    min_workers: int = 0  # elastic only; 0 means 1
    max_workers: int = 0  # elastic only; 0 means `workers`
    non_root: bool = True  # run as uid 1000 (mpiuser), SSH keys at /home/mpiuser/.ssh; False runs as root
    mlflow_uri_from: str = "configmap"  # where MLFLOW_TRACKING_URI comes from: configmap or secret
    checkpoint_size: str = "10Gi"
    controller: str = "gloo"  # horovodrun --gloo or --mpi (OpenMPI over the operator's ssh); elastic: gloo
    api: str = "mpijob"  # mpijob: an MPIJob for the MPI operator; trainer: a TrainJob and its TrainingRuntime

    def __post_init__(self) -> None:
        self.check_fields()
        for name in ("image", "gpu_image"):
            value = getattr(self, name)
            if value and not _IMAGE.fullmatch(value):
                raise HvdgenError(f"--{flag(name)} {value!r} is not an image reference: "
                                  "use e.g. registry.example.com/team/mnist:v1 (lower-case, no spaces)")
        if "@" in self.image and self.gpus_per_worker and not self.gpu_image:
            raise HvdgenError(f"--image {self.image!r} is pinned by digest, so no CUDA tag can be derived from it: "
                              "give --gpu-image too, or --gpus-per-worker 0")
        if not _DNS1123_LABEL.fullmatch(self.namespace) or len(self.namespace) > 63:
            raise HvdgenError(f"--namespace {self.namespace!r} is not a Kubernetes namespace name: "
                              "use lower-case letters, digits and '-', at most 63 characters (e.g. ml-team)")
        if self.mlflow_uri_from not in MLFLOW_SOURCES:
            raise HvdgenError(f"--mlflow-uri-from {self.mlflow_uri_from!r} is not known: choose configmap or secret")
        if self.controller not in CONTROLLERS:
            raise HvdgenError(f"--controller {self.controller!r} is not known: choose gloo or mpi")
        if self.api not in APIS:
            raise HvdgenError(f"--api {self.api!r} is not known: choose mpijob or trainer")
        self._check_trainer()
        if self.elastic and self.controller == "mpi":
            raise HvdgenError("elastic Horovod runs on Gloo only (horovodrun ignores --mpi there): "
                              "use --controller gloo, or --no-elastic for an MPI job")
        size = parse_quantity(self.checkpoint_size)
        if size is None:
            raise HvdgenError(f"--checkpoint-size {self.checkpoint_size!r} is not a storage size: e.g. 10Gi")
        if not MIN_CLAIM <= size <= MAX_CLAIM:
            raise HvdgenError(f"--checkpoint-size {self.checkpoint_size} is outside 1Gi .. 64Ti, the sizes volume "
                              "provisioners grant: e.g. --checkpoint-size 10Gi")
        if self.elastic:
            low, high = self.min_np_workers, self.max_np_workers
            if not 1 <= low <= self.workers <= high:
                raise HvdgenError(f"elastic worker counts must satisfy 1 <= --min-workers ({low}) <= --workers "
                                  f"({self.workers}) <= --max-workers ({high}): e.g. --min-workers 1 "
                                  f"--workers {max(self.workers, 1)} --max-workers {max(high, self.workers)}")
        elif self.min_workers or self.max_workers:
            raise HvdgenError("--min-workers and --max-workers apply to elastic jobs only: add --elastic, "
                              "or leave them out")

    def _check_trainer(self) -> None:
        """What a TrainJob cannot run (see hvdgen/k8s/trainjob.py)."""
        if self.api != "trainer":
            return
        if self.elastic:
            raise HvdgenError("a TrainJob has a fixed node count, so it cannot run elastic Horovod: use --api mpijob "
                              "(the default) for an elastic job, or --no-elastic")
        if not self.non_root:
            raise HvdgenError("the Trainer mounts the job's SSH key with mode 0640, which ssh and sshd refuse to use "
                              "as root: leave out --root (the images' user mpiuser, the default), or use --api mpijob")

    @property
    def min_np_workers(self) -> int:
        return self.min_workers or 1

    @property
    def max_np_workers(self) -> int:
        return self.max_workers or self.workers

    def updated(self, **changes) -> "K8sOptions":
        """These answers with the given options changed; None means "keep the recorded answer"."""
        if changes.get("elastic") is False:
            changes = {"min_workers": 0, "max_workers": 0} | {k: v for k, v in changes.items() if v is not None}
        return self.with_changes(changes)
