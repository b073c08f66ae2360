"""Bad Kubernetes input is rejected with one line that names the problem and the fix.

Two tables. The first breaks one thing in a valid generated MPIJob, the way users do by hand, and
checks the validator's message. The second runs the real `hvdgen k8s` command on bad manifests, bad
options and bad `.hvdgen.yaml` answers: each row must exit non-zero with exactly one line on stderr
and leave every file of the project byte-for-byte as it was.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hvdgen.cli import main
from hvdgen.k8s.core import core_problems, pod_template_problems
from hvdgen.k8s.mpijob import build_checkpoint_claim, build_mpijob
from hvdgen.k8s.options import K8sOptions
from hvdgen.k8s.trainjob import build_training_runtime, build_trainjob
from hvdgen.k8s.validate import documents_problems, object_problems
from hvdgen.spec import SPEC_FILE, ProjectSpec

SPEC = ProjectSpec(name="demo")
GOOD = build_mpijob(SPEC, K8sOptions(workers=2, gpus_per_worker=2), gpu=True)
REPLICAS = "spec.mpiReplicaSpecs"
WORKER_POD = f"{REPLICAS}.Worker.template.spec"
WORKER_C = f"{WORKER_POD}.containers[0]"
LAUNCHER_C = f"{REPLICAS}.Launcher.template.spec.containers[0]"


def worker(job):
    return job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def launcher(job):
    return job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]


def worker_pod(job):
    return job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]


def misspelled_limits(job):
    worker(job)["resources"]["limit"] = worker(job)["resources"].pop("limits")


def gpu_in_requests_only(job):
    worker(job)["resources"]["requests"]["nvidia.com/gpu"] = worker(job)["resources"]["limits"].pop("nvidia.com/gpu")


def two_launchers(job):
    job["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2


def not_dns_1035(job):
    job["metadata"]["name"] = "Demo_Job"


def negative_slots(job):
    job["spec"]["slotsPerWorker"] = -1


def misspelled_top_level(job):
    job["spec"]["slotPerWorker"] = job["spec"].pop("slotsPerWorker")


def np_does_not_match(job):
    args = launcher(job)["args"]
    args[args.index("-np") + 1] = "8"


def no_hostfile(job):
    args = launcher(job)["args"]
    del args[args.index("--hostfile"):args.index("--hostfile") + 2]


def restart_always(job):
    job["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicy"] = "Always"


def bad_clean_policy(job):
    job["spec"]["runPolicy"]["cleanPodPolicy"] = "Succeeded"


def bad_quantity(job):
    worker(job)["resources"]["limits"]["memory"] = "16 GB"


def quoted_integer(job):
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = "2"


def gpu_on_launcher(job):
    launcher(job)["resources"]["limits"]["nvidia.com/gpu"] = 1


def slots_not_gpus(job):
    job["spec"]["slotsPerWorker"] = 1
    args = launcher(job)["args"]
    args[args.index("-np") + 1] = "2"


def too_long_for_workers(job):
    job["metadata"]["name"] = "a" * 55
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 12


def zero_workers(job):
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 0


def unknown_replica_type(job):
    job["spec"]["mpiReplicaSpecs"]["Workers"] = job["spec"]["mpiReplicaSpecs"].pop("Worker")


def old_api_version(job):
    job["apiVersion"] = "kubeflow.org/v1"


def no_launcher(job):
    del job["spec"]["mpiReplicaSpecs"]["Launcher"]


def no_worker(job):
    del job["spec"]["mpiReplicaSpecs"]["Worker"]


def no_containers(job):
    worker_pod(job)["containers"] = []


def no_image(job):
    del launcher(job)["image"]


def privileged(job):
    worker(job)["securityContext"]["privileged"] = True


def privilege_escalation(job):
    launcher(job)["securityContext"]["allowPrivilegeEscalation"] = True


def host_network(job):
    worker_pod(job)["hostNetwork"] = True


def host_pid(job):
    worker_pod(job)["hostPID"] = True


def host_ipc(job):
    worker_pod(job)["hostIPC"] = True


def host_path(job):
    worker_pod(job)["volumes"].append({"name": "data", "hostPath": {"path": "/mnt/data"}})
    worker(job)["volumeMounts"].append({"name": "data", "mountPath": "/data"})


def host_port(job):
    worker(job)["ports"][0]["hostPort"] = 2222


def sys_admin(job):
    worker(job)["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}


def unconfined(job):
    worker_pod(job)["securityContext"]["seccompProfile"] = {"type": "Unconfined"}


def literal_aws_secret(job):
    launcher(job)["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"})


def literal_mlflow_password(job):
    worker(job)["env"].append({"name": "MLFLOW_TRACKING_PASSWORD", "value": "hunter2"})


def password_in_uri(job):
    launcher(job)["env"][0] = {"name": "MLFLOW_TRACKING_URI", "value": "https://me:s3cret@mlflow.example.com"}


def token_from_configmap(job):
    launcher(job)["env"].append({"name": "MLFLOW_TRACKING_TOKEN",
                                 "valueFrom": {"configMapKeyRef": {"name": "demo-mlflow", "key": "token"}}})


def too_many_gpus(job):
    worker(job)["resources"]["limits"]["nvidia.com/gpu"] = 1000
    job["spec"]["slotsPerWorker"] = 1000
    args = launcher(job)["args"]
    args[args.index("-np") + 1] = "2000"


def half_a_gpu(job):
    worker(job)["resources"]["limits"]["nvidia.com/gpu"] = "500m"


def absurd_cpu(job):
    worker(job)["resources"]["limits"]["cpu"] = "40000"


def absurd_memory(job):
    worker(job)["resources"]["limits"]["memory"] = "100Pi"


def negative_memory(job):
    launcher(job)["resources"]["requests"]["memory"] = "-1Gi"


def request_above_limit(job):
    launcher(job)["resources"]["requests"]["cpu"] = "4"


def model_split_gpus_not_stages(job):
    job["metadata"]["labels"].update({"hvdgen/strategy": "model-split", "hvdgen/stages": "2"})
    worker(job)["resources"]["limits"]["nvidia.com/gpu"] = 3
    job["spec"]["slotsPerWorker"] = 1
    args = launcher(job)["args"]
    args[args.index("-np") + 1] = "2"


def model_split_one_rank_per_gpu(job):
    job["metadata"]["labels"].update({"hvdgen/strategy": "model-split", "hvdgen/stages": "2"})


def pipeline_not_whole(job):
    job["metadata"]["labels"].update({"hvdgen/strategy": "pipeline", "hvdgen/stages": "4"})
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 3
    args = launcher(job)["args"]
    args[args.index("-np") + 1] = "6"


def tensor_not_whole_groups(job):
    job["metadata"]["labels"].update({"hvdgen/strategy": "tensor", "hvdgen/tp": "4"})
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 3
    args = launcher(job)["args"]
    args[args.index("-np") + 1] = "6"


def tensor_group_across_workers(job):
    job["metadata"]["labels"].update({"hvdgen/strategy": "tensor", "hvdgen/tp": "4"})
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 4
    args = launcher(job)["args"]
    args[args.index("-np") + 1] = "8"


# (break, field path the message must name, words of the fix the message must contain)
CASES = [
    (misspelled_limits, f"{WORKER_C}.resources", ["'limit'", "did you mean 'limits'"]),
    (gpu_in_requests_only, f"{WORKER_C}.resources.requests", ["nvidia.com/gpu", "move it to", "limits"]),
    (two_launchers, f"{REPLICAS}.Launcher.replicas", ["exactly 1", "replicas: 1"]),
    (not_dns_1035, "metadata.name", ["DNS-1035", "rename it", "'demo-job'"]),
    (negative_slots, "spec.slotsPerWorker", ["must not be negative", "0 or more"]),
    (misspelled_top_level, "spec", ["'slotPerWorker'", "did you mean 'slotsPerWorker'"]),
    (np_does_not_match, f"{LAUNCHER_C}.args", ["-np 8", "set -np 4"]),
    (no_hostfile, f"{LAUNCHER_C}.args", ["--hostfile /etc/mpi/hostfile"]),
    (restart_always, f"{REPLICAS}.Worker.restartPolicy", ["'Always'", "OnFailure or Never"]),
    (bad_clean_policy, "spec.runPolicy.cleanPodPolicy", ["'Succeeded'", "Running, All or None"]),
    (bad_quantity, f"{WORKER_C}.resources.limits.memory", ['"16 GB"', "quantity", "4Gi"]),
    (quoted_integer, f"{REPLICAS}.Worker.replicas", ['"2"', "expected integer", "without quotes"]),
    (gpu_on_launcher, f"{LAUNCHER_C}.resources.limits", ["runs no rank", "runLauncherAsWorker"]),
    (slots_not_gpus, "spec.slotsPerWorker", ["2 GPUs", "slotsPerWorker: 2"]),
    (too_long_for_workers, "metadata.name", ["'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-worker-11'",
                                             "longer than 63", "rename it"]),
    (zero_workers, f"{REPLICAS}.Worker.replicas", ["at least 1"]),
    (unknown_replica_type, f"{REPLICAS}.Workers", ["'Workers'", "did you mean 'Worker'"]),
    (old_api_version, "apiVersion", ["kubeflow.org/v2beta1"]),
    (no_launcher, f"{REPLICAS}.Launcher", ["missing", "exactly one Launcher"]),
    (no_worker, f"{REPLICAS}.Worker", ["missing", "add a Worker"]),
    (no_containers, f"{WORKER_POD}.containers", ["no container", "add one"]),
    (no_image, f"{LAUNCHER_C}.image", ["missing", "image"]),
    (privileged, f"{WORKER_C}.securityContext.privileged", ["whole node", "remove it"]),
    (privilege_escalation, f"{LAUNCHER_C}.securityContext.allowPrivilegeEscalation", ["set it to false"]),
    (host_network, f"{WORKER_POD}.hostNetwork", ["network namespace", "remove it"]),
    (host_pid, f"{WORKER_POD}.hostPID", ["process namespace", "remove it"]),
    (host_ipc, f"{WORKER_POD}.hostIPC", ["IPC namespace", "remove it"]),
    (host_path, f"{WORKER_POD}.volumes[2].hostPath", ["'data'", "folder of the node", "persistentVolumeClaim"]),
    (host_port, f"{WORKER_C}.ports[0].hostPort", ["port of the node", "remove hostPort"]),
    (sys_admin, f"{WORKER_C}.securityContext.capabilities.add", ["SYS_ADMIN", "baseline", "remove it"]),
    (unconfined, f"{WORKER_POD}.securityContext.seccompProfile.type", ["Unconfined", "RuntimeDefault"]),
    (literal_aws_secret, f"{LAUNCHER_C}.env[4].value", ["AWS_SECRET_ACCESS_KEY", "credential", "secretKeyRef"]),
    (literal_mlflow_password, f"{WORKER_C}.env[4].value", ["MLFLOW_TRACKING_PASSWORD", "Secret", "secretKeyRef"]),
    (password_in_uri, f"{LAUNCHER_C}.env[0].value", ["MLFLOW_TRACKING_URI", "password inside a URL", "Secret"]),
    (token_from_configmap, f"{LAUNCHER_C}.env[4].valueFrom.configMapKeyRef", ["MLFLOW_TRACKING_TOKEN", "Secret"]),
    (too_many_gpus, f"{WORKER_C}.resources.limits.nvidia.com/gpu", ["1000 GPUs", "at most 64"]),
    (half_a_gpu, f"{WORKER_C}.resources.limits.nvidia.com/gpu", ["500m", "whole number of GPUs"]),
    (absurd_cpu, f"{WORKER_C}.resources.limits.cpu", ["40000", "at most 1024"]),
    (absurd_memory, f"{WORKER_C}.resources.limits.memory", ["100Pi", "at most 32Ti"]),
    (negative_memory, f"{LAUNCHER_C}.resources.requests.memory", ["-1Gi", "negative"]),
    (request_above_limit, f"{LAUNCHER_C}.resources.requests.cpu", ["request 4", "limit 1"]),
    (model_split_gpus_not_stages, f"{WORKER_C}.resources.limits", ["3 GPUs", "2 stages", "give 2 GPUs"]),
    (model_split_one_rank_per_gpu, "spec.slotsPerWorker", ["is 2", "1 model-split rank", "slotsPerWorker: 1"]),
    (pipeline_not_whole, f"{REPLICAS}.Worker.replicas", ["6 ranks", "4 stages", "multiple of 4"]),
    (tensor_not_whole_groups, f"{REPLICAS}.Worker.replicas", ["6 ranks", "groups of tp 4", "multiple of 4"]),
    (tensor_group_across_workers, "spec.slotsPerWorker", ["slotsPerWorker 2", "tp 4 across workers",
                                                          "multiple of 4"]),
]


def test_the_starting_manifest_is_valid():
    assert object_problems(GOOD) == []


@pytest.mark.parametrize("breaker,path,words", CASES, ids=[c[0].__name__ for c in CASES])
def test_broken_manifest_is_rejected_naming_field_and_fix(breaker, path, words):
    job = copy.deepcopy(GOOD)
    breaker(job)
    problems = object_problems(job)
    assert problems, f"{breaker.__name__} was accepted"
    matching = [p for p in problems if p.path == path]
    assert matching, f"no problem at {path}: {[str(p) for p in problems]}"
    line = str(matching[0])
    assert "\n" not in line and line.startswith(f"{path}: ")
    for word in words:
        assert word in line, f"{word!r} missing from: {line}"


def test_pod_template_is_checked_against_the_core_schema():
    template = copy.deepcopy(GOOD["spec"]["mpiReplicaSpecs"]["Worker"]["template"])
    template["spec"]["containers"][0]["imagePullPolicy"] = 3
    problems = pod_template_problems(template, "spec.mpiReplicaSpecs.Worker.template")
    assert [p.path for p in problems] == [f"{WORKER_C}.imagePullPolicy"]


def test_core_objects_are_checked_strictly():
    claim = build_checkpoint_claim(SPEC, K8sOptions())
    assert core_problems(claim) == []
    claim["spec"]["accessMode"] = claim["spec"].pop("accessModes")
    problems = object_problems(claim)
    assert len(problems) == 1 and "accessMode" in problems[0].message and problems[0].path == "spec"


@pytest.mark.parametrize("name,value", [
    ("TOKENIZERS_PARALLELISM", "false"),  # a word that starts with TOKEN is not a token
    ("GOOGLE_APPLICATION_CREDENTIALS", "/var/secrets/google/key.json"),  # a path to a mounted key
    ("AWS_SECRET_ACCESS_KEY", "$(SHARED_SECRET)"),  # a reference to another variable
    ("MLFLOW_TRACKING_URI", "http://mlflow.mlflow.svc:5000"),  # no credentials in the URL
    ("NCCL_SOCKET_IFNAME", "^lo,docker"),
])
def test_ordinary_environment_is_not_taken_for_a_credential(name, value):
    job = copy.deepcopy(GOOD)
    worker(job)["env"].append({"name": name, "value": value})
    assert object_problems(job) == []


def test_root_mode_and_credentials_from_a_secret_pass():
    job = build_mpijob(SPEC, K8sOptions(workers=2, gpus_per_worker=2, non_root=False), gpu=True)
    launcher(job)["env"].append({"name": "AWS_SECRET_ACCESS_KEY",
                                 "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}}})
    assert object_problems(job) == []


ELASTIC = build_mpijob(SPEC, K8sOptions(workers=2, gpus_per_worker=2, elastic=True, min_workers=1,
                                        max_workers=3), gpu=True)


@pytest.mark.parametrize("option,value,words", [
    ("-np", "8", ["-np 8 is outside --min-np 2 .. --max-np 6"]),
    ("--max-np", "5", ["--max-np 5 is not a multiple of slotsPerWorker 2", "--max-np 4"]),
])
def test_elastic_counts_are_checked(option, value, words):
    job = copy.deepcopy(ELASTIC)
    assert object_problems(job) == []
    args = launcher(job)["args"]
    args[args.index(option) + 1] = value
    lines = [str(p) for p in object_problems(job)]
    assert any(all(w in line for w in words) for line in lines), lines


def test_elastic_hosts_from_the_operator_need_slots_per_host():
    """The operator's discover_hosts.sh prints bare host names: without --slots-per-host Horovod
    would give each host no slots."""
    job = copy.deepcopy(ELASTIC)
    args = launcher(job)["args"]
    del args[args.index("--slots-per-host"):args.index("--slots-per-host") + 2]
    assert [str(p) for p in object_problems(job)] == [
        "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].args: the operator's "
        "/etc/mpi/discover_hosts.sh lists hosts without slots, so horovodrun has none to give: "
        "add --slots-per-host <slotsPerWorker>"]


def test_an_elastic_launcher_on_mpi_is_flagged():
    """horovodrun runs elastic jobs on Gloo and drops --mpi without a word: a hand edit that asks
    for MPI would not get it."""
    job = copy.deepcopy(ELASTIC)
    args = launcher(job)["args"]
    args[args.index("--gloo")] = "--mpi"
    assert [str(p) for p in object_problems(job)] == [
        "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].args: elastic horovodrun runs on Gloo "
        "only and ignores --mpi: replace --mpi with --gloo, or drop the discovery script for an MPI job"]


def test_a_file_without_an_mpijob_is_not_a_job():
    claim = build_checkpoint_claim(SPEC, K8sOptions())
    lines = [str(p) for p in documents_problems([claim])]
    assert lines == ["holds no MPIJob or TrainJob (only PersistentVolumeClaim): give the job's manifest, e.g. "
                     "k8s/base/mpijob.yaml or `kubectl kustomize k8s/overlays/gpu`"]


# The command-line table ------------------------------------------------------------------------

def _job_text(breaker=None, gpu: bool = False) -> str:
    job = build_mpijob(ProjectSpec(name="demo"), K8sOptions(gpus_per_worker=2), gpu=gpu)
    if breaker:
        breaker(job)
    return yaml.safe_dump(job, sort_keys=False)


def _trainer_text(breaker) -> str:
    """A TrainJob with its runtime, the TrainJob broken by `breaker`."""
    opts = K8sOptions(api="trainer")
    job = build_trainjob(SPEC, opts)
    breaker(job)
    return yaml.safe_dump_all([build_training_runtime(SPEC, opts), job], sort_keys=False)


def _answer(key: str, value) -> Callable[[str], str]:
    """An edit of the project's .hvdgen.yaml: one answer replaced."""
    def edit(text: str) -> str:
        answers = yaml.safe_load(text)
        answers[key] = value
        return yaml.safe_dump(answers, sort_keys=False)
    return edit


CONFIGMAP = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\ndata:\n  EPOCHS: '3'\n"


@dataclass(frozen=True)
class Bad:
    """One bad input: files written into a fresh copy of a generated project, then `hvdgen ARGS`
    ({p} is the project folder). The one line must contain every word of `words`."""

    id: str
    args: tuple
    words: tuple
    files: dict = field(default_factory=dict)  # project-relative path -> text, bytes, or an edit of the text
    strategy: str = "data"  # which generated project to start from
    stdin: bytes | None = None
    swapped: tuple = ()  # project-relative paths turned from folder into file, or from file into folder


def _check(name: str, content, *words, **extra) -> Bad:
    return Bad(name, ("k8s", "--check", "--file", "{p}/job.yaml"), words, {"job.yaml": content}, **extra)


def _option(name: str, *args_and_words, strategy: str = "data") -> Bad:
    split = args_and_words.index("|")
    return Bad(name, ("k8s", "--project", "{p}", *args_and_words[:split]), args_and_words[split + 1:],
               strategy=strategy)


def _spec_file(name: str, content, *words) -> Bad:
    return Bad(name, ("k8s", "--project", "{p}"), words, {SPEC_FILE: content})


BAD = [
    # --check --file: files that are not a job's manifest
    _check("not-a-manifest", "foo: bar\n", "no apiVersion and kind", "k8s/base/mpijob.yaml"),
    _check("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00", "binary file", "not YAML"),
    _check("not-utf8", "kind: MPIJob\nmetadata:\n  name: caf\xe9\n".encode("latin-1"), "not UTF-8", "save it as UTF-8"),
    _check("empty", "", "holds no Kubernetes object"),
    _check("only-comments", "# nothing here\n---\n", "holds no Kubernetes object"),
    _check("a-list", "- apiVersion: v1\n- kind: MPIJob\n", "is a list, not a Kubernetes object"),
    _check("invalid-yaml", "apiVersion: v1\nkind: [\n", "not valid YAML", "line"),
    _check("configmap-only", CONFIGMAP, "holds no MPIJob or TrainJob (only ConfigMap)"),
    _check("kind-missing", "apiVersion: kubeflow.org/v2beta1\nmetadata: {name: demo}\n", "kind: missing"),
    _check("old-api-version", _job_text(old_api_version), "kubeflow.org/v1", "kubeflow.org/v2beta1"),
    _check("trainjob-np", _trainer_text(lambda job: job["spec"]["trainer"].update(numNodes=3)),
           "spec.trainer.args", "numNodes (3) x numProcPerNode (1) = 3", "set -np 3"),
    _check("trainjob-runtime-typo", _trainer_text(lambda job: job["spec"]["runtimeRef"].update(name="demo-hvd")),
           "spec.runtimeRef", "'demo-hvd'", "TrainingRuntime 'demo-horovod'"),
    # --check --file: an MPIJob that cannot run
    _check("no-launcher", _job_text(no_launcher), "Launcher: missing"),
    _check("no-worker", _job_text(no_worker), "Worker: missing", "add a Worker"),
    _check("containers-empty", _job_text(no_containers), "containers: has no container"),
    _check("no-image", _job_text(no_image), "image: missing"),
    _check("privileged", _job_text(privileged), "privileged: true gives the container the whole node"),
    _check("privilege-escalation", _job_text(privilege_escalation), "allowPrivilegeEscalation", "set it to false"),
    _check("host-network", _job_text(host_network), "hostNetwork", "network namespace"),
    _check("host-pid", _job_text(host_pid), "hostPID", "process namespace"),
    _check("host-ipc", _job_text(host_ipc), "hostIPC", "IPC namespace"),
    _check("host-path", _job_text(host_path), "hostPath", "persistentVolumeClaim"),
    _check("host-port", _job_text(host_port), "hostPort", "remove hostPort"),
    _check("capability", _job_text(sys_admin), "SYS_ADMIN"),
    _check("seccomp-unconfined", _job_text(unconfined), "Unconfined"),
    _check("aws-secret-literal", _job_text(literal_aws_secret), "AWS_SECRET_ACCESS_KEY", "secretKeyRef"),
    _check("mlflow-password-literal", _job_text(literal_mlflow_password), "MLFLOW_TRACKING_PASSWORD", "secretKeyRef"),
    _check("password-in-uri", _job_text(password_in_uri), "password inside a URL"),
    _check("token-in-configmap", _job_text(token_from_configmap), "MLFLOW_TRACKING_TOKEN", "from a ConfigMap"),
    _check("credential-in-configmap-data", CONFIGMAP + "  AWS_SECRET_ACCESS_KEY: abc\n---\n" + _job_text(),
           "data.AWS_SECRET_ACCESS_KEY", "Secret instead of a ConfigMap"),
    _check("1000-gpus", _job_text(too_many_gpus, gpu=True), "1000 GPUs", "at most 64"),
    _check("half-a-gpu", _job_text(half_a_gpu, gpu=True), "whole number of GPUs"),
    _check("40000-cpus", _job_text(absurd_cpu), "40000", "at most 1024"),
    _check("100Pi-memory", _job_text(absurd_memory), "100Pi", "at most 32Ti"),
    _check("negative-memory", _job_text(negative_memory), "-1Gi is negative"),
    _check("request-above-limit", _job_text(request_above_limit), "request 4 is above the limit 1"),
    _check("zero-size-claim", _job_text() + "---\n" + yaml.safe_dump(
        {**build_checkpoint_claim(SPEC, K8sOptions()), "spec": {"accessModes": ["ReadWriteMany"],
                                                                "resources": {"requests": {"storage": "0Gi"}}}}),
           "0Gi asks for no space"),
    Bad("stdin-binary", ("k8s", "--check", "--file", "-"), ("<stdin> is a binary file",), stdin=b"\x00\x01\x02"),
    Bad("file-missing", ("k8s", "--check", "--file", "{p}/nope.yaml"), ("cannot read", "No such file")),
    Bad("file-is-a-folder", ("k8s", "--check", "--file", "{p}/k8s"), ("cannot read", "directory")),
    # --check on the project's own k8s/
    Bad("project-binary-manifest", ("k8s", "--check", "--project", "{p}"), ("mpijob.yaml is a binary file",),
        {"k8s/base/mpijob.yaml": b"\x00\xffMPIJob"}),
    Bad("project-kustomization-loop", ("k8s", "--check", "--project", "{p}"), ("includes itself",),
        {"k8s/overlays/cpu/kustomization.yaml": "resources:\n- ../../base\n- .\n"}),
    # options of `hvdgen k8s`
    _option("workers-100000", "--workers", "100000", "|", "--workers", "between 1 and 1024", "100000"),
    _option("workers-0", "--workers", "0", "|", "--workers", "between 1 and 1024"),
    _option("gpus-1000", "--gpus-per-worker", "1000", "|", "--gpus-per-worker", "between 0 and 64"),
    _option("gpus-negative", "--gpus-per-worker", "-1", "|", "--gpus-per-worker", "between 0 and 64"),
    _option("max-workers-absurd", "--elastic", "--max-workers", "5000", "|", "--max-workers", "between 0 and 1024"),
    _option("checkpoint-0", "--checkpoint-size", "0", "|", "--checkpoint-size 0", "1Gi .. 64Ti"),
    _option("checkpoint-0Gi", "--checkpoint-size", "0Gi", "|", "--checkpoint-size 0Gi", "1Gi .. 64Ti"),
    _option("checkpoint-10-bytes", "--checkpoint-size", "10", "|", "1Gi .. 64Ti"),
    _option("checkpoint-1000Pi", "--checkpoint-size", "1000Pi", "|", "1Gi .. 64Ti"),
    _option("checkpoint-words", "--checkpoint-size", "lots", "|", "not a storage size", "10Gi"),
    _option("file-without-check", "--file", "x.yaml", "|", "--file works with --check only"),
    _option("check-with-options", "--check", "--workers", "3", "|", "--check changes nothing", "--workers"),
    _option("model-split-3-gpus", "--gpus-per-worker", "3", "|", "2 GPUs of its own", "got 3",
            "--gpus-per-worker 2", strategy="model-split"),
    _option("model-split-1-gpu", "--gpus-per-worker", "1", "|", "--gpus-per-worker must be 2 x ranks per worker",
            strategy="model-split"),
    _option("pipeline-3-workers", "--workers", "3", "|", "-np 3", "4 stages", "--workers 4", strategy="pipeline"),
    _option("pipeline-elastic", "--elastic", "|", "cannot be elastic", strategy="pipeline"),
    Bad("folder-where-a-file-goes", ("k8s", "--project", "{p}", "--workers", "3"),
        ("k8s/README.md is a folder", "move it away"), swapped=("k8s/README.md",)),
    Bad("file-where-a-folder-goes", ("k8s", "--project", "{p}", "--workers", "3"),
        ("k8s/overlays/gpu is a file", "move it away"), swapped=("k8s/overlays/gpu",)),
    Bad("project-is-a-file", ("k8s", "--project", "{p}/train.py"), ("is a file", "project folder")),
    # .hvdgen.yaml answers that cannot be used
    _spec_file("k8s-5", _answer("k8s", 5), "k8s must be a mapping", "got 5"),
    _spec_file("k8s-list", _answer("k8s", [1, 2]), "k8s must be a mapping", "[1, 2]"),
    _spec_file("k8s-string", _answer("k8s", "workers=2"), "k8s must be a mapping", "'workers=2'"),
    _spec_file("workers-two", _answer("k8s", {"workers": "two"}), "workers must be a whole number", "'two'"),
    _spec_file("elastic-yes-please", _answer("k8s", {"elastic": "yes please"}), "elastic must be true or false"),
    _spec_file("non-root-string", _answer("k8s", {"non_root": "no"}), "non_root must be true or false"),
    _spec_file("workers-true", _answer("k8s", {"workers": True}), "workers must be a whole number", "True"),
    _spec_file("checkpoint-size-number", _answer("k8s", {"checkpoint_size": 10}), "checkpoint_size must be text"),
    _spec_file("namespace-number", _answer("k8s", {"namespace": 5}), "namespace must be text"),
    _spec_file("unknown-k8s-key", _answer("k8s", {"gpus": 2}), "unknown keys ['gpus']"),
    _spec_file("api-unknown", _answer("k8s", {"api": "kubeflow"}), "--api 'kubeflow' is not known", "trainer"),
    _spec_file("api-number", _answer("k8s", {"api": 5}), "api must be text"),
    _spec_file("recorded-trainer-elastic", _answer("k8s", {"api": "trainer", "elastic": True}), "fixed node count"),
    _spec_file("recorded-workers-100000", _answer("k8s", {"workers": 100000}), "between 1 and 1024"),
    _spec_file("answers-binary", b"\x00\x01\x02\xff", SPEC_FILE, "not UTF-8"),
    _spec_file("answers-empty", "", SPEC_FILE, "answers"),
    _spec_file("answers-invalid-yaml", "name: [\n", SPEC_FILE, "not valid YAML"),
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Path]:
    """One generated project per strategy, copied afresh for every row."""
    root = tmp_path_factory.mktemp("generated")
    made = {}
    for strategy, extra in (("data", []), ("model-split", []), ("pipeline", ["--stages", "4"])):
        result = CliRunner().invoke(main, ["new", "demo", "--strategy", strategy, *extra, "-o", str(root / strategy)])
        assert result.exit_code == 0, result.output
        made[strategy] = root / strategy / "demo"
    return made


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None): equal snapshots, equal trees."""
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_bad_k8s_input_is_one_line_and_changes_nothing(bad, generated, tmp_path):
    project = tmp_path / "demo"
    shutil.copytree(generated[bad.strategy], project, symlinks=True)
    for rel, content in bad.files.items():
        path = project / rel
        if callable(content):
            content = content(path.read_text())
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for rel in bad.swapped:
        path = project / rel
        if path.is_dir():
            shutil.rmtree(path)
            path.write_text("mine\n")
        else:
            path.unlink()
            (path / "mine").mkdir(parents=True)
    before = snapshot(project)

    args = [arg.replace("{p}", str(project)) for arg in bad.args]
    result = CliRunner().invoke(main, args, input=bad.stdin)

    assert isinstance(result.exception, SystemExit), f"crashed: {result.exception!r}"
    assert result.exit_code != 0, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert all(word in lines[0] for word in bad.words), lines[0]
    assert snapshot(project) == before
    assert not list(project.glob(".hvdgen-k8s-*")), "staging folder left behind"


def test_the_table_covers_enough():
    assert len(BAD) >= 40 and len({b.id for b in BAD}) == len(BAD)


def pull_policy_number(job):
    worker(job)["imagePullPolicy"] = 3


def port_as_text(job):
    worker(job)["ports"][0]["containerPort"] = "ssh"


@pytest.mark.parametrize("breaker", [None, misspelled_limits, pull_policy_number, port_as_text])
def test_cached_core_validator_finds_what_kubernetes_validate_finds(breaker):
    """core.py builds kubernetes-validate's validator once per kind; it must report the same first error."""
    import kubernetes_validate

    from hvdgen.k8s.core import KUBERNETES_VERSION
    from hvdgen.k8s.problems import field_path

    job = copy.deepcopy(GOOD)
    if breaker:
        breaker(job)
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
               "template": job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]}
    try:
        kubernetes_validate.validate(wrapped, KUBERNETES_VERSION, strict=True)
        expected = []
    except kubernetes_validate.ValidationError as error:
        expected = [(field_path(error.path), error.message)]
    assert len(expected) == (breaker is not None)
    assert [(p.path, p.message.rsplit(": ", 1)[0]) for p in core_problems(wrapped)] == expected


def _paths(node, prefix=()):
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in children:
        yield from _paths(value, prefix + (key,))


def test_hand_written_rules_never_crash_on_odd_values():
    """Users write anything anywhere. Every field of a job, replaced by values of the wrong type: the
    rules hvdgen wrote (the schemas are libraries) report or pass, and never raise."""
    from hvdgen.k8s import env_secrets, resources, rules, security

    job = build_mpijob(ProjectSpec(name="d", strategy="model-split"), K8sOptions(gpus_per_worker=2, elastic=True),
                       gpu=True)
    checks = (rules.operator_problems, rules.convention_problems, security.security_problems,
              env_secrets.env_problems, resources.resource_problems)
    tried = 0
    for path in list(_paths(job))[1:]:
        for odd in (None, 5, -3, "x", "", [], {}, True, 1.5, [None], {"a": None}):
            broken = copy.deepcopy(job)
            parent = broken
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = odd
            for check in checks:
                assert all(isinstance(p.path, str) for p in check(broken)), (path, odd, check.__name__)
                tried += 1
    assert tried > 5000


def test_recorded_answers_of_any_type_are_refused_in_one_line():
    """Whatever .hvdgen.yaml holds under k8s:, K8sOptions accepts it or raises HvdgenError (one line)."""
    from dataclasses import fields

    from hvdgen.errors import HvdgenError

    for answer in fields(K8sOptions):
        for odd in (None, 5, -3, 10**9, "x", "", [], {}, True, 1.5, [None], {"a": None}):
            try:
                K8sOptions.from_answers({answer.name: odd})
            except HvdgenError as error:
                assert "\n" not in error.message, (answer.name, odd)
