"""Rules of a Kubeflow Trainer v2 Horovod job that its CRD schemas do not express.

The Trainer admits a TrainJob whose runtime cannot start Horovod, and says nothing: the launcher
then never gets the SSH keys, or starts before any node's sshd, or the job never succeeds. What
the Trainer does with each field is in hvdgen/k8s/trainjob.py. Three groups:
- a runtime on its own: the MPI policy, a `launcher` and a `node` job each with a container named
  `node`, the launcher labelled as the TrainJob's trainer and waiting for the nodes, success when
  the launcher succeeds, sshd's host key where the keys are mounted, no GPUs on the launcher;
- a TrainJob on its own: the runtime kinds, the MPI plugin's reserved variables (its own admission
  check), `resourcesPerNode` (which the Trainer gives to the launcher, not the ranks), credentials;
- a TrainJob with its runtime: the horovodrun line against numNodes x numProcPerNode (the rules of
  rules.py, in the Trainer's words), ranks per node against GPUs, one image for launcher and nodes.
"""

from __future__ import annotations

import difflib

from hvdgen.k8s.env_secrets import env_list_problems
from hvdgen.k8s.launch import HOSTFILE
from hvdgen.k8s.names import MAX_LABEL, dns1035_fix, is_dns1035_label, longest_pod_name
from hvdgen.k8s.pods import mapping
from hvdgen.k8s.problems import Problem
from hvdgen.k8s.rules import (RESTART_POLICIES, Terms, argv_of, gpu_keys, gpu_request_problems, gpu_slot_problems, is_int,
                              launch_problems, value_at)
from hvdgen.k8s.trainjob import (ANCESTOR_LABEL, ANCESTOR_TRAINER, API_VERSION, LAUNCHER, NODE, RESERVED_ENV,
                                 RUNTIME_KINDS)

JOBS = "spec.template.spec.replicatedJobs"
DEFAULT_SSH_PATH = "/root/.ssh"  # the CRD's default sshAuthMountPath
DEFAULT_RUNTIME_KIND = "ClusterTrainingRuntime"  # the CRD's default runtimeRef.kind


def _jobs(runtime: dict) -> list[tuple[int, dict]]:
    jobs = mapping(runtime, "spec", "template", "spec").get("replicatedJobs")
    return [(i, job) for i, job in enumerate(jobs) if isinstance(job, dict)] if isinstance(jobs, list) else []


def _job(runtime: dict, name: str) -> tuple[int, dict] | None:
    return next(((i, job) for i, job in _jobs(runtime) if job.get("name") == name), None)


def _node_container(job: dict) -> tuple[int, dict] | None:
    """The container the Trainer equips (SSH keys, hostfile, the TrainJob's command): the one named `node`."""
    listed = mapping(job, "template", "spec", "template", "spec").get("containers")
    return next(((i, c) for i, c in enumerate(listed) if isinstance(c, dict) and c.get("name") == NODE), None) \
        if isinstance(listed, list) else None


def _pod_path(i: int) -> str:
    return f"{JOBS}[{i}].template.spec.template.spec"


def runtime_problems(runtime: dict) -> list[Problem]:
    """A TrainingRuntime or ClusterTrainingRuntime that can start Horovod."""
    problems = []
    mpi = mapping(runtime, "spec", "mlPolicy", "mpi")
    if not mpi:
        problems.append(Problem("spec.mlPolicy.mpi", "missing: Horovod needs the MPI policy (with it the Trainer makes "
                                "the SSH keys and the hostfile): add mlPolicy.mpi with numProcPerNode, "
                                "mpiImplementation: OpenMPI and sshAuthMountPath"))
    if mpi.get("runLauncherAsNode") is True:
        problems.append(Problem("spec.mlPolicy.mpi.runLauncherAsNode", "true lists the launcher pod as a host, but it "
                                "runs horovodrun and no sshd: set it to false"))
    names = [job.get("name") for _, job in _jobs(runtime)]
    suggested = set()
    for i, job in _jobs(runtime):
        name = job.get("name")
        if isinstance(name, str) and name not in (LAUNCHER, NODE):
            close = difflib.get_close_matches(name, (LAUNCHER, NODE), n=1, cutoff=0.6)
            if close and close[0] not in names:
                suggested.add(close[0])
                problems.append(Problem(f"{JOBS}[{i}].name", f"'{name}' is not a job the MPI plugin knows: did you "
                                        f"mean '{close[0]}'?"))
    for name, role in ((NODE, "the ranks' pods, serving sshd"), (LAUNCHER, "the pod that runs horovodrun")):
        if name not in names and name not in suggested:
            problems.append(Problem(JOBS, f"has no '{name}' job ({role}): add one named {name}"))
    node, launcher = _job(runtime, NODE), _job(runtime, LAUNCHER)
    for found in (node, launcher):
        if found and _node_container(found[1]) is None:
            problems.append(Problem(f"{_pod_path(found[0])}.containers", f"has no container named '{NODE}': the "
                                    "Trainer mounts the SSH keys (and the launcher's hostfile) into that container "
                                    f"only: name the job's container {NODE}"))
    if launcher:
        problems += _launcher_problems(*launcher)
    if node and value_at(node[1], "template", "metadata", "labels", ANCESTOR_LABEL) == ANCESTOR_TRAINER:
        problems.append(Problem(f"{JOBS}[{node[0]}].template.metadata.labels", f"'{ANCESTOR_LABEL}: "
                                f"{ANCESTOR_TRAINER}' on the node job sends the TrainJob's command to the ranks' "
                                "pods: label the launcher job instead"))
    success = mapping(runtime, "spec", "template", "spec", "successPolicy")
    targets = success.get("targetReplicatedJobs")
    if node and launcher and (not isinstance(targets, list) or LAUNCHER not in targets or NODE in targets):
        problems.append(Problem("spec.template.spec.successPolicy", "the job would wait for the nodes to complete, "
                                "and their sshd never does: set successPolicy: {operator: All, "
                                f"targetReplicatedJobs: [{LAUNCHER}]}}"))
    if node and mpi:
        problems += _sshd_problems(node[0], node[1], mpi.get("sshAuthMountPath", DEFAULT_SSH_PATH))
    for i, job in _jobs(runtime):
        policy = value_at(job, "template", "spec", "template", "spec", "restartPolicy")
        if policy is not None and policy not in RESTART_POLICIES:
            problems.append(Problem(f"{_pod_path(i)}.restartPolicy", f"{policy!r} is not allowed for a Job's pods: "
                                    "use OnFailure or Never"))
    return problems


def _launcher_problems(i: int, job: dict) -> list[Problem]:
    problems = []
    if value_at(job, "template", "metadata", "labels", ANCESTOR_LABEL) != ANCESTOR_TRAINER:
        problems.append(Problem(f"{JOBS}[{i}].template.metadata.labels", f"missing '{ANCESTOR_LABEL}: "
                                f"{ANCESTOR_TRAINER}': without it the TrainJob's command, args and image never reach "
                                "the launcher: add the label"))
    depends = job.get("dependsOn")
    if not (isinstance(depends, list) and {"name": NODE, "status": "Ready"} in depends):
        problems.append(Problem(f"{JOBS}[{i}].dependsOn", "the launcher does not wait for the nodes, so horovodrun "
                                f"may reach a node before its sshd is up: add dependsOn: [{{name: {NODE}, "
                                "status: Ready}]"))
    found = _node_container(job)
    if found:
        where = f"{_pod_path(i)}.containers[{found[0]}].resources"
        keys = gpu_keys(value_at(found[1], "resources", "limits")) + gpu_keys(value_at(found[1], "resources",
                                                                                          "requests"))
        if keys:
            problems.append(Problem(where, f"the launcher runs no rank but asks for '{keys[0]}': remove it (the "
                                    "ranks' GPUs belong to the node job)"))
    return problems


def _sshd_problems(i: int, job: dict, ssh_path) -> list[Problem]:
    """A node's sshd must use the job's key, mounted at sshAuthMountPath, as its host key."""
    found = _node_container(job)
    if not found:
        return []
    index, container = found
    where = f"{_pod_path(i)}.containers[{index}]"
    problems = gpu_request_problems(container, f"{where}.resources")
    argv = argv_of(container)
    if "-h" in argv[:-1] and isinstance(ssh_path, str):
        key = argv[argv.index("-h") + 1]
        if key.rsplit("/", 1)[0] != ssh_path.rstrip("/"):
            problems.append(Problem(f"{where}.args", f"sshd's host key {key} is not in sshAuthMountPath {ssh_path}, "
                                    f"where the Trainer mounts the job's key: use -h {ssh_path.rstrip('/')}/id_rsa"))
    return problems


def trainjob_problems(trainjob: dict) -> list[Problem]:
    """A TrainJob on its own."""
    problems = []
    ref = mapping(trainjob, "spec", "runtimeRef")
    kind = ref.get("kind", DEFAULT_RUNTIME_KIND)
    if isinstance(kind, str) and kind not in RUNTIME_KINDS:
        problems.append(Problem("spec.runtimeRef.kind", f"'{kind}' is not a runtime kind: use TrainingRuntime (in "
                                "the job's namespace) or ClusterTrainingRuntime"))
    group = ref.get("apiGroup", API_VERSION.split("/")[0])
    if isinstance(group, str) and group != API_VERSION.split("/")[0]:
        problems.append(Problem("spec.runtimeRef.apiGroup", f"'{group}' is not the Trainer's API group: use "
                                f"{API_VERSION.split('/')[0]}, or leave it out"))
    trainer = mapping(trainjob, "spec", "trainer")
    env = trainer.get("env")
    reserved = sorted({e.get("name") for e in env if isinstance(e, dict)} & set(RESERVED_ENV)) \
        if isinstance(env, list) else []
    if reserved:
        problems.append(Problem("spec.trainer.env", f"{', '.join(reserved)} is set by the Trainer's MPI plugin, which "
                                "rejects a TrainJob that sets it: remove it"))
    problems += env_list_problems(env, "spec.trainer.env")
    if "resourcesPerNode" in trainer:
        problems.append(Problem("spec.trainer.resourcesPerNode", "the Trainer gives it to the launcher, which runs "
                                "no rank (runLauncherAsNode: false): remove it and set the ranks' resources (GPUs) "
                                "in the runtime's node container"))
    return problems + _name_problems(value_at(trainjob, "metadata", "name"), trainer.get("numNodes"))


def _name_problems(name, nodes) -> list[Problem]:
    """The JobSet names pods `<name>-launcher-0-0` and `<name>-node-0-<i>`: each must be a DNS-1035 label."""
    if not isinstance(name, str) or not name:
        return []
    nodes = nodes if is_int(nodes) and nodes > 0 else 1
    pod = longest_pod_name(name, nodes, "trainer")
    if is_dns1035_label(name) and is_dns1035_label(pod):
        return []
    why = (f"pod name '{pod}' is longer than {MAX_LABEL} characters" if len(pod) > MAX_LABEL
           else f"'{name}' is not a DNS-1035 label (lower-case letters, digits and '-', starting with a letter)")
    return [Problem("metadata.name", f"{why}: rename it, e.g. '{dns1035_fix(name, nodes, 'trainer')}'")]


def find_runtime(trainjob: dict, documents: list) -> tuple[dict | None, list[str]]:
    """The runtime among `documents` that the TrainJob names, and the runtimes there are."""
    ref = mapping(trainjob, "spec", "runtimeRef")
    kind, name = ref.get("kind", DEFAULT_RUNTIME_KIND), ref.get("name")
    namespace = value_at(trainjob, "metadata", "namespace") or "default"
    runtimes = [doc for doc in documents if isinstance(doc, dict) and doc.get("kind") in RUNTIME_KINDS]
    for runtime in runtimes:
        same_namespace = runtime["kind"] != "TrainingRuntime" or (
            value_at(runtime, "metadata", "namespace") or "default") == namespace
        if runtime["kind"] == kind and value_at(runtime, "metadata", "name") == name and same_namespace:
            return runtime, []
    return None, [f"{doc['kind']} {value_at(doc, 'metadata', 'name')!r}" for doc in runtimes]


def pair_problems(trainjob: dict, documents: list) -> list[Problem]:
    """A TrainJob against its runtime, when the runtime is among the documents. One that is not may
    be installed in the cluster already, so it is named only when other runtimes are there (a typo)."""
    ref = mapping(trainjob, "spec", "runtimeRef")
    if not isinstance(ref.get("name"), str) or ref.get("kind", DEFAULT_RUNTIME_KIND) not in RUNTIME_KINDS:
        return []  # trainjob_problems and the schema name what is wrong with the reference
    runtime, others = find_runtime(trainjob, documents)
    if runtime is None:
        if not others:
            return []
        return [Problem("spec.runtimeRef", f"names {ref.get('kind', DEFAULT_RUNTIME_KIND)} {ref.get('name')!r}, "
                        f"which is not among these manifests ({', '.join(others)}): fix its kind or name")]
    trainer, mpi = mapping(trainjob, "spec", "trainer"), mapping(runtime, "spec", "mlPolicy", "mpi")
    node, launcher = _job(runtime, NODE), _job(runtime, LAUNCHER)
    node_container = _node_container(node[1]) if node else None
    limits = value_at(node_container[1], "resources", "limits") if node_container else None
    nodes = trainer.get("numNodes", value_at(runtime, "spec", "mlPolicy", "numNodes"))
    slots = trainer.get("numProcPerNode", mpi.get("numProcPerNode", 1))
    if "numProcPerNode" not in trainer and slots == 1:  # the plugin's default: one rank per GPU
        gpus = [limits[key] for key in gpu_keys(limits)]
        slots = gpus[0] if gpus and is_int(gpus[0]) and gpus[0] > 1 else 1
    terms = Terms("numNodes", "spec.trainer.numNodes" if "numNodes" in trainer else "spec.mlPolicy.numNodes",
                  "numProcPerNode", "spec.trainer.numProcPerNode" if "numProcPerNode" in trainer
                  else "spec.mlPolicy.mpi.numProcPerNode", NODE,
                  f"{_pod_path(node[0])}.containers[{node_container[0]}].resources.limits" if node_container else "",
                  discovery=False)
    launcher_container = _node_container(launcher[1]) if launcher else None
    command = trainer["command"] if isinstance(trainer.get("command"), list) else (
        launcher_container[1].get("command") if launcher_container else None)
    args = trainer["args"] if isinstance(trainer.get("args"), list) else (
        launcher_container[1].get("args") if launcher_container else None)
    argv = argv_of({"command": command, "args": args})
    where = "spec.trainer.args" if "args" in trainer or not launcher_container else \
        f"{_pod_path(launcher[0])}.containers[{launcher_container[0]}].args"
    labels = {**mapping(runtime, "metadata", "labels"), **mapping(trainjob, "metadata", "labels")}
    problems = []
    if is_int(nodes) and nodes < 1:
        problems.append(Problem(terms.workers_path, f"is {nodes}, so no node runs a rank: set numNodes: 1 or more"))
    if not (is_int(slots) and slots >= 1 and (nodes is None or is_int(nodes))):
        return problems  # the schema names a numProcPerNode below 1 or a count that is not a number
    if not any(arg.rsplit("/", 1)[-1] in ("horovodrun", "mpirun") for arg in argv):
        problems.append(Problem("spec.trainer.command", "the launcher runs no horovodrun: set command: [horovodrun] "
                                f"and args: [-np N, --hostfile, {HOSTFILE}, --gloo, python, train.py]"))
    problems += launch_problems(argv, where, nodes if nodes is not None else 1, slots, labels, terms)
    if node_container:
        problems += gpu_slot_problems(limits, slots, labels, terms)
    image = trainer.get("image")
    if image and node_container and node_container[1].get("image") != image:
        problems.append(Problem("spec.trainer.image", f"the Trainer sets it on the launcher only, while the ranks run "
                                f"the runtime's {node_container[1].get('image')}: make the two the same, or leave "
                                "trainer.image out"))
    return problems
