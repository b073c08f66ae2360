"""`k8s/README.md` of a generated project: the exact kubectl steps for this job's names and sizes, for
an MPIJob or for a Trainer TrainJob (`hvdgen k8s --api trainer`)."""

from __future__ import annotations

from hvdgen.k8s.launch import DISCOVER_HOSTS
from hvdgen.k8s.mpijob import (CHECKPOINT_DIR, build_mpijob, checkpoint_claim_name, default_gpu_image,
                               default_image, mlflow_source_name, ssh_path)
from hvdgen.k8s.names import job_name
from hvdgen.k8s.options import K8sOptions
from hvdgen.k8s.ranks import slots_per_worker
from hvdgen.k8s.trainjob import build_trainjob, runtime_name
from hvdgen.spec import ProjectSpec

OPERATOR_MANIFEST = "https://raw.githubusercontent.com/kubeflow/mpi-operator/v0.8.2/deploy/v2beta1/mpi-operator.yaml"
TRAINER_RELEASE = "v2.3.0"
TRAINER_MANIFESTS = f"https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref={TRAINER_RELEASE}"


def _launch_line(spec: ProjectSpec, opts: K8sOptions, gpu: bool) -> str:
    if opts.api == "trainer":
        container = build_trainjob(spec, opts, gpu)["spec"]["trainer"]
    else:
        launcher = build_mpijob(spec, opts, gpu)["spec"]["mpiReplicaSpecs"]["Launcher"]
        container = launcher["template"]["spec"]["containers"][0]
    return " ".join(container["command"] + container["args"])


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _baked_data(spec: ProjectSpec) -> str:
    """What data the image carries, where the project's default data is a file the build makes."""
    if spec.model != "gpt":
        return ""
    return ("\nThe images carry the tokens the job trains on (`data/tokens`): the ones in the project folder, "
            "if `make data TEXT=...` made them before the build, else the build makes them from the Python "
            "standard library, as `make train` does.\n")


def _ranks(spec: ProjectSpec, opts: K8sOptions, gpus: int) -> str:
    """How the overlay's ranks sit on its workers, in words, with the numbers of this job."""
    slots = slots_per_worker(spec, gpus)
    world = opts.workers * slots
    pod, field = ("node", "numProcPerNode") if opts.api == "trainer" else ("worker", "slotsPerWorker")
    if not gpus:
        shape = f"{_count(opts.workers, 'CPU ' + pod)} x 1 rank"
    elif spec.strategy == "model-split":
        shape = (f"{_count(opts.workers, pod)} x {_count(gpus, 'GPU')}; each rank puts its {spec.stages} "
                 f"stages on {spec.stages} GPUs of its own, so {_count(slots, 'rank')} per {pod}")
    else:
        shape = f"{_count(opts.workers, pod)} x {_count(gpus, 'GPU')}, one rank per GPU"
    shape += f" (`{field}: {slots}`): {_count(world, 'rank')}"
    if spec.strategy == "pipeline":
        shape += f", {_count(world // spec.model_ranks, 'pipeline')} of {spec.stages} stages"
        shape += f" x tp {spec.tp}" if spec.tp > 1 else ""
    if spec.strategy == "tensor":
        shape += f", {_count(world // spec.tp, 'tensor-parallel group')} of {spec.tp}"
    return shape


def _controller(opts: K8sOptions) -> str:
    return ("Ranks start through OpenMPI (`horovodrun --mpi`: `mpirun` over the operator's ssh); "
            "`hvdgen k8s --controller gloo` starts them with Gloo instead.") if opts.controller == "mpi" else (
        "Ranks start with Gloo (`horovodrun --gloo`), as elastic Horovod requires." if opts.elastic else
        "Ranks start with Gloo (`horovodrun --gloo`); `hvdgen k8s --controller mpi` starts them through OpenMPI's "
        "`mpirun` instead (both images carry it).")


def _images(spec: ProjectSpec, opts: K8sOptions) -> str:
    return f"""## 1. Build and push the images

From the project folder (BuildKit is needed for the cache mounts):

```bash
docker build -t {default_image(spec, opts)} .
docker push {default_image(spec, opts)}
docker build -f Dockerfile.cuda -t {default_gpu_image(spec, opts)} .
docker push {default_gpu_image(spec, opts)}
```
{_baked_data(spec)}
"""


def _mlflow(opts: K8sOptions, uri_source: str, ns: str) -> str:
    return f"""## 2. Optional: send metrics to an MLflow server

Every pod reads `MLFLOW_TRACKING_URI` from the {opts.mlflow_uri_from} `{uri_source}`, key
`MLFLOW_TRACKING_URI`. Without it rank 0 logs to the embedded store inside its pod, which is lost
with the pod. Create it before applying:

```bash
kubectl create configmap {uri_source} -n {ns} --from-literal=MLFLOW_TRACKING_URI=http://mlflow.mlflow.svc:5000
# or, when the URI holds credentials (then generate with --mlflow-uri-from secret):
kubectl create secret generic {uri_source} -n {ns} --from-literal=MLFLOW_TRACKING_URI='https://user:token@mlflow.example.com'
```

"""


def readme(spec: ProjectSpec, opts: K8sOptions) -> str:
    if opts.api == "trainer":
        return _trainer_readme(spec, opts)
    name, ns = job_name(spec.name, opts.workers, opts.api), opts.namespace
    overlay = "cpu"
    other_note = "          # on GPU nodes: kubectl apply -k k8s/overlays/gpu" if opts.gpus_per_worker else ""
    uri_source = mlflow_source_name(spec, opts)
    gpu_rows = (f"| `overlays/gpu/` | {_ranks(spec, opts, opts.gpus_per_worker)}, "
                f"image `{default_gpu_image(spec, opts)}`, "
                f"NCCL environment; runs `{_launch_line(spec, opts, True)}` |\n") if opts.gpus_per_worker else ""
    elastic = ""
    if opts.elastic:
        elastic = f"""
## Elastic training

This job is elastic: it starts with {opts.workers} workers and keeps training with any number
from {opts.min_np_workers} to {opts.max_np_workers}. horovodrun asks `{DISCOVER_HOSTS}` (written by the
operator) which workers are running. A worker pod that fails and restarts rejoins once Horovod's
blacklist cooldown has passed (20-30 s the first time, longer each time it fails again). If rank
0's pod is lost, another worker becomes rank 0 and goes on writing the checkpoints and the same
MLflow run. Change the number of workers while it runs:

```bash
kubectl patch mpijob {name} -n {ns} --type merge \\
  -p '{{"spec":{{"mpiReplicaSpecs":{{"Worker":{{"replicas":{opts.max_np_workers}}}}}}}}}'
```

The training script itself must be elastic (`hvdgen new --elastic`), or a lost worker still stops
the job.
"""
    non_root = (f"The pods run as the images' non-root user `mpiuser` (uid 1000), without privilege escalation "
                f"or capabilities; the operator mounts the job's SSH keys at `{ssh_path(opts)}`, and workers' sshd "
                f"listens on port 2222. Only if your cluster needs it, `hvdgen k8s --root` runs them as root.") \
        if opts.non_root else (
        "The pods run as root (`hvdgen k8s --root`), and the operator mounts the job's SSH keys at `/root/.ssh`. "
        "`hvdgen k8s --non-root` (the default for new projects) runs them as the images' user `mpiuser`.")
    controller = _controller(opts)
    return f"""# Kubernetes: `{name}` as an MPIJob

These manifests run the project with the [Kubeflow MPI Operator](https://github.com/kubeflow/mpi-operator)
(`kubeflow.org/v2beta1`, operator v0.8 or newer). They were generated by `hvdgen k8s` from the answers
in `../.hvdgen.yaml`; change the answers with `hvdgen k8s --workers N --gpus-per-worker G --image ...`
rather than by hand, and check hand edits with `hvdgen k8s --check`.

| folder | what it runs |
| --- | --- |
| `base/` | the MPIJob and the `{checkpoint_claim_name(spec, opts)}` PersistentVolumeClaim |
| `overlays/cpu/` | {_ranks(spec, opts, 0)}, image `{default_image(spec, opts)}`; runs `{_launch_line(spec, opts, False)}` |
{gpu_rows}
The launcher is created only when every worker's sshd accepts connections
(`launcherCreationPolicy: WaitForWorkersReady`). Ranks run on the workers; rank 0 writes checkpoints
to `{CHECKPOINT_DIR}`, which is the claim, so a restarted job resumes where it stopped: a failed
launcher is started again up to `runPolicy.backoffLimit` (3) times, as `python -m hvd_runtime.retry`
restarts a job on a host (which is why the launcher runs horovodrun without it). The claim asks
for `ReadWriteMany` because every worker mounts it: on a single node, or a cluster without such a
storage class, change `accessModes` to `ReadWriteOnce`. {non_root} {controller}

## 0. Once per cluster: the MPI Operator

```bash
kubectl apply --server-side -f {OPERATOR_MANIFEST}
```

The older Kubeflow training-operator also defines `mpijobs.kubeflow.org` (version v1); the two cannot
be installed side by side.

{_images(spec, opts)}{_mlflow(opts, uri_source, ns)}## 3. Run

```bash
kubectl apply -k k8s/overlays/{overlay}{other_note}
kubectl get pods -n {ns} -l app.kubernetes.io/name={name} -w
kubectl logs -n {ns} -f job/{name}-launcher
kubectl get mpijob {name} -n {ns} -o jsonpath='{{.status.conditions[-1].type}}{{"\\n"}}'
```

The last command prints the job's latest condition: `Created`, `Running`, `Restarting`, `Succeeded`
or `Failed`; `kubectl wait mpijob/{name} -n {ns} --for=condition=Succeeded --timeout=24h` blocks
until it succeeds. A job that does not start shows why in `kubectl describe mpijob {name} -n {ns}`
(look at the Events).

## 4. Delete

```bash
kubectl delete mpijob {name} -n {ns}          # the job; checkpoints stay on the claim
kubectl delete -k k8s/overlays/{overlay}      # the job and the checkpoint claim (all checkpoints)
```

Apply again after the first command and training resumes from the last checkpoint.
{elastic}"""


def _trainer_readme(spec: ProjectSpec, opts: K8sOptions) -> str:
    name, ns = job_name(spec.name, opts.workers, opts.api), opts.namespace
    other_note = "          # on GPU nodes: kubectl apply -k k8s/overlays/gpu" if opts.gpus_per_worker else ""
    gpu_rows = (f"| `overlays/gpu/` | {_ranks(spec, opts, opts.gpus_per_worker)}, "
                f"image `{default_gpu_image(spec, opts)}`, "
                f"NCCL environment; runs `{_launch_line(spec, opts, True)}` |\n") if opts.gpus_per_worker else ""
    pods = f"jobset.sigs.k8s.io/jobset-name={name}"
    return f"""# Kubernetes: `{name}` as a Kubeflow Trainer TrainJob

These manifests run the project with [Kubeflow Trainer](https://github.com/kubeflow/trainer) v2
(`trainer.kubeflow.org/v1alpha1`, Trainer {TRAINER_RELEASE} or newer). They were generated by
`hvdgen k8s --api trainer` from the answers in `../.hvdgen.yaml`; change the answers with
`hvdgen k8s --workers N --gpus-per-worker G --image ...` rather than by hand, and check hand edits
with `hvdgen k8s --check`. `hvdgen k8s --api mpijob` writes an MPIJob for the MPI Operator instead.

| folder | what it runs |
| --- | --- |
| `base/` | the TrainJob `{name}`, the TrainingRuntime `{runtime_name(spec, opts)}` it runs on, and the `{checkpoint_claim_name(spec, opts)}` PersistentVolumeClaim |
| `overlays/cpu/` | {_ranks(spec, opts, 0)}, image `{default_image(spec, opts)}`; runs `{_launch_line(spec, opts, False)}` |
{gpu_rows}
The Trainer ships no runtime for Horovod, so the project brings its own: a `node` job, whose pods
serve sshd and run the ranks, and a `launcher` job that runs horovodrun once every node is Ready
(`dependsOn`). The Trainer's MPI plugin makes the job's SSH keys, mounts them at
`{ssh_path(opts)}` in both, and writes the launcher's hostfile (`/etc/mpi/hostfile`, one line per
node with `numProcPerNode` slots). The job succeeds when the launcher does. The TrainJob holds what
changes from run to run: `numNodes`, `numProcPerNode` and the horovodrun line, whose `-np` is
their product; `hvdgen k8s --check` checks that they agree. The images and the GPUs are the
runtime's, since the Trainer applies a TrainJob's `image` and `resourcesPerNode` to the launcher
only.

Rank 0 writes checkpoints to `{CHECKPOINT_DIR}`, which is the claim, so a job applied again resumes
where it stopped, as does a failed launcher, which the runtime's launcher job starts again up to its
`backoffLimit` (3) times, as `python -m hvd_runtime.retry` restarts a job on a host (which is why the
launcher runs horovodrun without it). The claim asks for `ReadWriteMany` because every node mounts it: on a single
node, or a cluster without such a storage class, change `accessModes` to `ReadWriteOnce`. The pods
run as the images' non-root user `mpiuser` (uid 1000), without privilege escalation or
capabilities; they cannot run as root here, because the Trainer mounts the private key with mode
0640, which ssh and sshd refuse as root. {_controller(opts)}

A TrainJob's node count is fixed, so elastic Horovod needs the MPIJob (`hvdgen k8s --api mpijob
--elastic`).

## 0. Once per cluster: Kubeflow Trainer

```bash
kubectl apply --server-side -k "{TRAINER_MANIFESTS}"
```

This installs the Trainer's controller and CRDs, and JobSet, which runs the pods. The runtime here
is namespaced (a TrainingRuntime), so nothing else is needed cluster-wide.

{_images(spec, opts)}{_mlflow(opts, mlflow_source_name(spec, opts), ns)}## 3. Run

```bash
kubectl apply -k k8s/overlays/cpu{other_note}
kubectl get pods -n {ns} -l {pods} -w
kubectl logs -n {ns} -f -l {pods},jobset.sigs.k8s.io/replicatedjob-name=launcher
kubectl get trainjob {name} -n {ns} -o jsonpath='{{.status.conditions[-1].type}}{{"\\n"}}'
```

The last command prints the job's latest condition: `Complete`, `Failed` or `Suspended`;
`kubectl wait trainjob/{name} -n {ns} --for=condition=Complete --timeout=24h` blocks until it
completes. A job that does not start shows why in `kubectl describe trainjob {name} -n {ns}` and
`kubectl describe jobset {name} -n {ns}` (look at the Events).

A TrainJob's `trainer` cannot change once created. To run with other sizes, delete the job (the
checkpoints stay), run `hvdgen k8s --workers N ...` and apply again.

## 4. Delete

```bash
kubectl delete trainjob {name} -n {ns}          # the job; checkpoints stay on the claim
kubectl delete -k k8s/overlays/cpu      # the job, its runtime and the checkpoint claim (all checkpoints)
```

Apply again after the first command and training resumes from the last checkpoint.
"""
