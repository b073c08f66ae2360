"""Walk a job's pod templates and their containers, with the field path of each for messages: an
MPIJob's replica specs, or a Trainer runtime's replicated jobs."""

from __future__ import annotations

from collections.abc import Iterator

REPLICAS = "spec.mpiReplicaSpecs"
CONTAINER_LISTS = ("initContainers", "containers")


def pod_specs(job: dict) -> Iterator[tuple[str, dict]]:
    """(path, pod spec) of every replica's template, e.g. `spec.mpiReplicaSpecs.Worker.template.spec`,
    or of every replicated job of a runtime, `spec.template.spec.replicatedJobs[0].template.spec.template.spec`."""
    for path, template in pod_templates(job):
        pod = template.get("spec")
        if isinstance(pod, dict):
            yield f"{path}.spec", pod


def pod_templates(job: dict) -> Iterator[tuple[str, dict]]:
    """(path, pod template) of an MPIJob's replicas or a runtime's replicated jobs."""
    specs = mapping(job, "spec", "mpiReplicaSpecs")
    for kind, replica in specs.items():
        template = replica.get("template") if isinstance(replica, dict) else None
        if isinstance(template, dict):
            yield f"{REPLICAS}.{kind}.template", template
    jobs = mapping(job, "spec", "template", "spec").get("replicatedJobs")
    for i, replicated in enumerate(jobs if isinstance(jobs, list) else []):
        template = mapping(replicated, "template", "spec", "template")
        if template:
            yield f"spec.template.spec.replicatedJobs[{i}].template.spec.template", template


def containers(pod: dict, path: str) -> Iterator[tuple[str, dict]]:
    """(path, container) of the pod's init containers and containers."""
    for key in CONTAINER_LISTS:
        items = pod.get(key)
        if isinstance(items, list):
            for i, container in enumerate(items):
                if isinstance(container, dict):
                    yield f"{path}.{key}[{i}]", container


def mapping(obj, *keys) -> dict:
    """The mapping at obj[k1][k2]..., or {} when any step is missing or not a mapping."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj if isinstance(obj, dict) else {}
