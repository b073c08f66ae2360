"""Broken manifests are rejected with one line that names the field and the fix.

Each case starts from a valid generated MPIJob and breaks one thing, the way users do by hand.
"""

from __future__ import annotations

import copy

import pytest

from hvdgen.k8s.core import core_problems, pod_template_problems
from hvdgen.k8s.mpijob import build_checkpoint_claim, build_mpijob
from hvdgen.k8s.options import K8sOptions
from hvdgen.k8s.validate import object_problems
from hvdgen.spec import ProjectSpec

SPEC = ProjectSpec(name="demo")
GOOD = build_mpijob(SPEC, K8sOptions(workers=2, gpus_per_worker=2), gpu=True)
REPLICAS = "spec.mpiReplicaSpecs"
WORKER_C = f"{REPLICAS}.Worker.template.spec.containers[0]"


def worker(job):
    return job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def launcher(job):
    return job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]


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


# (break, field path the message must name, words of the fix the message must contain)
CASES = [
    (misspelled_limits, f"{WORKER_C}.resources", ["'limit'", "did you mean 'limits'"]),
    (gpu_in_requests_only, f"{WORKER_C}.resources.requests", ["nvidia.com/gpu", "move it to", "limits"]),
    (two_launchers, f"{REPLICAS}.Launcher.replicas", ["exactly 1", "replicas: 1"]),
    (not_dns_1035, "metadata.name", ["DNS-1035", "rename it", "'demo-job'"]),
    (negative_slots, "spec.slotsPerWorker", ["must not be negative", "0 or more"]),
    (misspelled_top_level, "spec", ["'slotPerWorker'", "did you mean 'slotsPerWorker'"]),
    (np_does_not_match, f"{REPLICAS}.Launcher.template.spec.containers[0].args", ["-np 8", "set -np 4"]),
    (no_hostfile, f"{REPLICAS}.Launcher.template.spec.containers[0].args", ["--hostfile /etc/mpi/hostfile"]),
    (restart_always, f"{REPLICAS}.Worker.restartPolicy", ["'Always'", "OnFailure or Never"]),
    (bad_clean_policy, "spec.runPolicy.cleanPodPolicy", ["'Succeeded'", "Running, All or None"]),
    (bad_quantity, f"{WORKER_C}.resources.limits.memory", ['"16 GB"', "quantity", "4Gi"]),
    (quoted_integer, f"{REPLICAS}.Worker.replicas", ['"2"', "expected integer", "without quotes"]),
    (gpu_on_launcher, f"{REPLICAS}.Launcher.template.spec.containers[0].resources.limits",
     ["runs no rank", "runLauncherAsWorker"]),
    (slots_not_gpus, "spec.slotsPerWorker", ["2 GPUs", "slotsPerWorker: 2"]),
    (too_long_for_workers, "metadata.name", ["'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-worker-11'", "longer than 63", "rename it"]),
    (zero_workers, f"{REPLICAS}.Worker.replicas", ["at least 1"]),
    (unknown_replica_type, f"{REPLICAS}.Workers", ["'Workers'", "did you mean 'Worker'"]),
    (old_api_version, "apiVersion", ["kubeflow.org/v2beta1"]),
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


def test_model_split_jobs_run_one_rank_per_worker():
    """hvdgen's model-split projects spread one rank's stages over a worker's GPUs."""
    job = copy.deepcopy(GOOD)
    job["metadata"]["labels"]["hvdgen/strategy"] = "model-split"
    problems = [str(p) for p in object_problems(job)]
    assert "spec.slotsPerWorker: is 2 but a model-split job runs one rank per worker over all its GPUs: " \
           "set slotsPerWorker: 1" in problems


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
