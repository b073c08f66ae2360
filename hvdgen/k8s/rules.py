"""Rules the CRD schema does not express.

The operator checks the first group after the API server accepted the object and reports only a
warning event, so the job just never starts. The second group are Horovod conventions whose
violation starts the job but wastes it: GPUs in requests only, a launcher holding GPUs it never
uses, `-np` that does not match workers x slots, horovodrun running every rank on the launcher.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from hvdgen.k8s.launch import DISCOVER_HOSTS, HOSTFILE, option_value
from hvdgen.k8s.mpijob import STAGES_LABEL, TP_LABEL
from hvdgen.k8s.names import MAX_LABEL, dns1035_fix, is_dns1035_label, last_worker_name
from hvdgen.k8s.problems import Problem

REPLICA_TYPES = ("Launcher", "Worker")
RESTART_POLICIES = ("Never", "OnFailure")
CLEAN_POD_POLICIES = ("All", "Running", "None")
LAUNCHER_POLICIES = ("AtStartup", "WaitForWorkersReady")
NON_NEGATIVE = (("spec", "slotsPerWorker"), ("spec", "runPolicy", "backoffLimit"),
                ("spec", "runPolicy", "activeDeadlineSeconds"), ("spec", "runPolicy", "ttlSecondsAfterFinished"))
REPLICAS = "spec.mpiReplicaSpecs"
MODEL_SPLIT_LABEL = ("hvdgen/strategy", "model-split")  # set by hvdgen/k8s/mpijob.py labels()


def value_at(obj, *keys):
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _replicas(spec: dict) -> int | None:
    value = value_at(spec, "replicas")
    return 1 if value is None else value if is_int(value) else None


def _name_problems(job: dict, workers: int | None) -> list[Problem]:
    name = value_at(job, "metadata", "name")
    if not isinstance(name, str) or not name:
        return [Problem("metadata.name", "missing: add a name such as 'mnist-ddp'")]
    count = workers if workers and workers > 0 else 1
    pod = last_worker_name(name, count)
    if not is_dns1035_label(name) or not is_dns1035_label(pod):
        why = (f"worker pod name '{pod}' is longer than {MAX_LABEL} characters" if len(pod) > MAX_LABEL
               else f"'{name}' is not a DNS-1035 label (lower-case letters, digits and '-', starting with a letter)")
        return [Problem("metadata.name", f"{why}: rename it, e.g. '{dns1035_fix(name, count)}'")]
    return []


def operator_problems(job: dict) -> list[Problem]:
    """What the MPI operator rejects after admission (mpi-operator v0.8 validation)."""
    problems = []
    specs = value_at(job, "spec", "mpiReplicaSpecs")
    specs = specs if isinstance(specs, dict) else {}
    for kind in specs:
        if kind not in REPLICA_TYPES:
            close = difflib.get_close_matches(str(kind), REPLICA_TYPES, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "use Launcher or Worker"
            problems.append(Problem(f"{REPLICAS}.{kind}", f"unknown replica type '{kind}': {hint} "
                                    "(the operator knows Launcher and Worker)"))
    if "Launcher" not in specs:
        problems.append(Problem(f"{REPLICAS}.Launcher", "missing: an MPIJob needs exactly one Launcher"))
    launcher = specs.get("Launcher") if isinstance(specs.get("Launcher"), dict) else None
    if launcher is not None and _replicas(launcher) not in (1, None):
        problems.append(Problem(f"{REPLICAS}.Launcher.replicas",
                                f"is {launcher['replicas']}, must be exactly 1: set replicas: 1"))
    worker = specs.get("Worker") if isinstance(specs.get("Worker"), dict) else None
    workers = _replicas(worker) if worker is not None else None
    if workers is not None and workers < 1:
        problems.append(Problem(f"{REPLICAS}.Worker.replicas",
                                f"is {workers}, must be at least 1: set replicas: 1 or more"))
    if "Worker" not in specs and value_at(job, "spec", "runLauncherAsWorker") is not True:
        problems.append(Problem(f"{REPLICAS}.Worker", "missing: the launcher runs no rank, so the ranks need "
                                "Workers: add a Worker (replicas: 1 or more) with the job's image"))
    problems += _container_list_problems(specs)
    for kind in REPLICA_TYPES:
        policy = value_at(specs, kind, "restartPolicy")
        if policy is not None and policy not in RESTART_POLICIES:
            problems.append(Problem(f"{REPLICAS}.{kind}.restartPolicy",
                                    f"{policy!r} is not allowed by the operator: use OnFailure or Never"))
    policy = value_at(job, "spec", "runPolicy", "cleanPodPolicy")
    if policy is not None and policy not in CLEAN_POD_POLICIES:
        problems.append(Problem("spec.runPolicy.cleanPodPolicy",
                                f"{policy!r} is not allowed: use Running, All or None"))
    policy = value_at(job, "spec", "launcherCreationPolicy")
    if policy is not None and policy not in LAUNCHER_POLICIES:
        problems.append(Problem("spec.launcherCreationPolicy",
                                f"{policy!r} is not allowed: use WaitForWorkersReady or AtStartup"))
    for keys in NON_NEGATIVE:
        value = value_at(job, *keys)
        if is_int(value) and value < 0:
            problems.append(Problem(".".join(keys), f"is {value}, must not be negative: set it to 0 or more"
                                    + (" (GPUs per worker, 1 on CPU)" if keys[-1] == "slotsPerWorker" else "")))
    return problems + _name_problems(job, workers)


def _container_list_problems(specs: dict) -> list[Problem]:
    """A replica's pod needs a container with an image: the launcher's runs horovodrun, a worker's sshd."""
    problems = []
    for kind in REPLICA_TYPES:
        replica = specs.get(kind)
        if not isinstance(replica, dict):
            continue
        where = f"{REPLICAS}.{kind}.template.spec.containers"
        listed = value_at(replica, "template", "spec", "containers")
        if listed == [] or value_at(replica, "template", "spec") is None:
            problems.append(Problem(where, "has no container: add one with a name and the job's image"))
        for i, container in _containers(replica):
            if not container.get("image"):
                problems.append(Problem(f"{where}[{i}].image", "missing: add the job's image"))
    return problems


def _containers(replica: dict | None) -> list[tuple[int, dict]]:
    containers = value_at(replica, "template", "spec", "containers")
    return [(i, c) for i, c in enumerate(containers) if isinstance(c, dict)] if isinstance(containers, list) else []


def gpu_keys(mapping) -> list[str]:
    return sorted(k for k in mapping if isinstance(k, str) and k.endswith("/gpu")) if isinstance(mapping, dict) else []


def _gpu_problems(specs: dict, run_launcher_as_worker: bool) -> list[Problem]:
    problems = []
    for kind in REPLICA_TYPES:
        for i, container in _containers(specs.get(kind)):
            where = f"{REPLICAS}.{kind}.template.spec.containers[{i}].resources"
            problems += gpu_request_problems(container, where)
            limits = value_at(container, "resources", "limits")
            if kind == "Launcher" and gpu_keys(limits) and not run_launcher_as_worker:
                problems.append(Problem(f"{where}.limits", f"the launcher runs no rank but asks for "
                                        f"'{gpu_keys(limits)[0]}': remove it, or set spec.runLauncherAsWorker: true"))
    return problems


def gpu_request_problems(container: dict, where: str) -> list[Problem]:
    """GPUs are allocated by limits: a GPU request must be a limit too, of the same amount."""
    problems = []
    requests, limits = value_at(container, "resources", "requests"), value_at(container, "resources", "limits")
    limits = limits if isinstance(limits, dict) else {}
    for key in gpu_keys(requests):
        if key not in limits:
            problems.append(Problem(f"{where}.requests", f"'{key}' in requests only: move it to "
                                    f"{where}.limits (GPUs are allocated by limits)"))
        elif str(limits[key]) != str(requests[key]):
            problems.append(Problem(f"{where}.requests", f"'{key}' request {requests[key]} differs from "
                                    f"limit {limits[key]}: remove the request, the limit is enough"))
    return problems


def argv_of(container: dict) -> list[str]:
    argv = []
    for key in ("command", "args"):
        value = container.get(key) or []
        if not isinstance(value, list):
            return []
        argv += [str(item) for item in value if isinstance(item, (str, int))]
    return argv


@dataclass(frozen=True)
class Terms:
    """How a job's kind names the numbers the launch rules compare, for paths and messages."""

    workers: str  # the count of ranks' pods, in words: "Worker replicas", "numNodes"
    workers_path: str
    slots: str  # ranks per pod: "slotsPerWorker", "numProcPerNode"
    slots_path: str
    pod: str  # a ranks' pod: "worker", "node"
    limits_path: str  # the ranks' container's limits, where its GPUs are
    discovery: bool  # whether horovodrun may take its hosts from the operator's discover_hosts.sh


MPIJOB_TERMS = Terms("Worker replicas", f"{REPLICAS}.Worker.replicas", "slotsPerWorker", "spec.slotsPerWorker",
                     "worker", f"{REPLICAS}.Worker.template.spec.containers[0].resources.limits", True)


def _launch_problems(job: dict, specs: dict) -> list[Problem]:
    """The launcher's horovodrun/mpirun line agrees with the workers and slots."""
    containers = _containers(specs.get("Launcher"))
    argv = argv_of(containers[0][1]) if containers else []
    workers = _replicas(specs["Worker"]) if isinstance(specs.get("Worker"), dict) else None
    slots = value_at(job, "spec", "slotsPerWorker")
    return launch_problems(argv, f"{REPLICAS}.Launcher.template.spec.containers[0].args", workers,
                           1 if slots is None else slots, value_at(job, "metadata", "labels"), MPIJOB_TERMS)


def launch_problems(argv: list[str], where: str, workers, slots, labels, terms: Terms) -> list[Problem]:
    """horovodrun's (or mpirun's) hosts and -np agree with the ranks' pods and the ranks per pod, and
    with a pipeline's or tensor-parallel group's size (`labels`: the job's, see mpijob.labels)."""
    if not any(arg.rsplit("/", 1)[-1] in ("horovodrun", "mpirun") for arg in argv):
        return []
    problems = []
    horovodrun = any(a.rsplit("/", 1)[-1] == "horovodrun" for a in argv)
    elastic = option_value(argv, "--host-discovery-script") is not None
    if horovodrun and not elastic and option_value(argv, "--hostfile", "-hostfile", "-H", "--hosts") is None:
        problems.append(Problem(where, f"horovodrun without --hostfile runs every rank on the launcher: "
                                f"add --hostfile {HOSTFILE}"
                                + (f" (or --host-discovery-script {DISCOVER_HOSTS})" if terms.discovery else "")))
    if horovodrun and elastic and not terms.discovery:
        problems.append(Problem(where, f"--host-discovery-script: the Trainer writes no {DISCOVER_HOSTS} (a TrainJob "
                                f"has a fixed node count): use --hostfile {HOSTFILE}, or an MPIJob for elastic "
                                "Horovod (hvdgen k8s --api mpijob)"))
    if horovodrun and option_value(argv, "--host-discovery-script") == DISCOVER_HOSTS \
            and option_value(argv, "--slots-per-host") is None and terms.discovery:
        problems.append(Problem(where, f"the operator's {DISCOVER_HOSTS} lists hosts without slots, so "
                                "horovodrun has none to give: add --slots-per-host <slotsPerWorker>"))
    if horovodrun and elastic and "--mpi" in argv:
        problems.append(Problem(where, "elastic horovodrun runs on Gloo only and ignores --mpi: "
                                "replace --mpi with --gloo, or drop the discovery script for an MPI job"))
    np_text = option_value(argv, "-np", "--num-proc", "-n", "--np")
    if not (is_int(workers) and is_int(slots) and np_text and np_text.isdigit()) or slots < 0 or workers < 1:
        return problems
    expected = workers * slots
    if elastic:
        low, high = option_value(argv, "--min-np"), option_value(argv, "--max-np")
        if low and high and low.isdigit() and high.isdigit() and not int(low) <= int(np_text) <= int(high):
            problems.append(Problem(where, f"-np {np_text} is outside --min-np {low} .. --max-np {high}: "
                                    "make min-np <= np <= max-np"))
        if high and high.isdigit() and int(high) % max(slots, 1):
            whole = int(high) // max(slots, 1) * slots or slots
            problems.append(Problem(where, f"--max-np {high} is not a multiple of {terms.slots} "
                                    f"{slots}: use whole {terms.pod}s, e.g. --max-np {whole}"))
    if int(np_text) != expected and not elastic:
        problems.append(Problem(where, f"-np {np_text} but {terms.workers} ({workers}) x {terms.slots} "
                                f"({slots}) = {expected}: set -np {expected}"))
    labels = labels if isinstance(labels, dict) else {}
    stages = str(labels.get(STAGES_LABEL))
    pipeline = labels.get(MODEL_SPLIT_LABEL[0]) == "pipeline"
    tp = str(labels.get(TP_LABEL))
    ranks = f"{terms.workers} ({workers}) x {terms.slots} ({slots}) = {expected} ranks"
    if pipeline and stages.isdigit() and int(stages) > 0:
        split = int(tp) if tp.isdigit() and int(tp) > 0 else 1
        size, shape = int(stages) * split, f"{stages} stages" + (f" x tp {split}" if split > 1 else "")
        if expected % size:
            problems.append(Problem(terms.workers_path, f"{ranks}, not whole pipelines of {shape}: make it a "
                                    f"multiple of {size}"))
    if tp.isdigit() and int(tp) > 0 and expected % int(tp):
        problems.append(Problem(terms.workers_path, f"{ranks}, not whole tensor-parallel groups of tp {tp}: make it "
                                f"a multiple of {tp}"))
    if tp.isdigit() and int(tp) > 0 and slots > 1 and slots % int(tp):
        problems.append(Problem(terms.slots_path, f"{terms.slots} {slots} splits tensor-parallel groups of tp "
                                f"{tp} across {terms.pod}s (they exchange activations in every layer): make it a "
                                f"multiple of {tp}"))
    return problems


def _slots_problems(job: dict, specs: dict) -> list[Problem]:
    """One rank per GPU: slotsPerWorker equals the GPUs in a worker's limits."""
    slots = value_at(job, "spec", "slotsPerWorker")
    for _, container in _containers(specs.get("Worker"))[:1]:
        return gpu_slot_problems(value_at(container, "resources", "limits"), 1 if slots is None else slots,
                                 value_at(job, "metadata", "labels"), MPIJOB_TERMS)
    return []


def gpu_slot_problems(limits, slots, labels, terms: Terms) -> list[Problem]:
    """One rank per GPU: the ranks per pod equal the GPUs in the ranks' container's limits.

    hvdgen's model-split jobs (labelled so) give each rank one GPU per stage instead: GPUs per pod
    = stages x ranks per pod.
    """
    gpus = [limits[key] for key in gpu_keys(limits)]
    if not (gpus and is_int(gpus[0]) and gpus[0] > 0 and is_int(slots) and slots >= 0):
        return []
    labels = labels if isinstance(labels, dict) else {}
    if labels.get(MODEL_SPLIT_LABEL[0]) == MODEL_SPLIT_LABEL[1]:
        return _model_split_slots(str(labels.get(STAGES_LABEL)), gpus[0], slots, terms)
    if slots != gpus[0]:
        return [Problem(terms.slots_path, f"is {slots} but each {terms.pod} has {gpus[0]} GPUs: "
                                          f"set {terms.slots}: {gpus[0]} (one rank per GPU)")]
    return []


def _model_split_slots(stages: str, gpus: int, slots: int, terms: Terms) -> list[Problem]:
    if not stages.isdigit() or int(stages) < 1:
        if slots and gpus % slots:
            return [Problem(terms.slots_path, f"is {slots} but the {terms.pod}'s {gpus} GPUs cannot be shared "
                                              "equally among that many model-split ranks: set "
                                              f"{terms.slots} to GPUs / stages, or label the job {STAGES_LABEL}")]
        return []
    stages = int(stages)
    if gpus % stages:
        return [Problem(terms.limits_path,
                        f"{gpus} GPUs per {terms.pod} is not a multiple of the model's {stages} stages (a model-split "
                        f"rank uses one GPU per stage): give {stages * max(slots, 1)} GPUs, {stages} x {terms.slots}")]
    if slots != gpus // stages:
        return [Problem(terms.slots_path, f"is {slots} but each {terms.pod}'s {gpus} GPUs hold {gpus // stages} "
                                          f"model-split rank(s) of {stages} stages (one GPU per stage): "
                                          f"set {terms.slots}: {gpus // stages}")]
    return []


def convention_problems(job: dict) -> list[Problem]:
    """Horovod-on-Kubernetes conventions: GPUs, slots and -np agree."""
    specs = value_at(job, "spec", "mpiReplicaSpecs")
    if not isinstance(specs, dict):
        return []
    return (_gpu_problems(specs, value_at(job, "spec", "runLauncherAsWorker") is True)
            + _slots_problems(job, specs) + _launch_problems(job, specs))
