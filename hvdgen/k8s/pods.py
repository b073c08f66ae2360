"""Walk an MPIJob's pod templates and their containers, with the field path of each for messages."""

from __future__ import annotations

from collections.abc import Iterator

REPLICAS = "spec.mpiReplicaSpecs"
CONTAINER_LISTS = ("initContainers", "containers")


def pod_specs(job: dict) -> Iterator[tuple[str, dict]]:
    """(path, pod spec) of every replica's template, e.g. `spec.mpiReplicaSpecs.Worker.template.spec`."""
    specs = (job.get("spec") or {}).get("mpiReplicaSpecs") if isinstance(job.get("spec"), dict) else None
    if not isinstance(specs, dict):
        return
    for kind, replica in specs.items():
        template = replica.get("template") if isinstance(replica, dict) else None
        pod = template.get("spec") if isinstance(template, dict) else None
        if isinstance(pod, dict):
            yield f"{REPLICAS}.{kind}.template.spec", pod


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
