"""Container resources that no node can give, or that the API server refuses, caught before `kubectl apply`.

A job asking for 40000 CPUs or 1000 GPUs is never scheduled and stays Pending without an error;
negative amounts, fractional GPUs and requests above limits are refused by the API server only when
the operator creates the pods, so the MPIJob itself is accepted and then never runs. The bounds are
in limits.py.
"""

from __future__ import annotations

from decimal import Decimal

from hvdgen.k8s.limits import MAX_CLAIM, MAX_GPUS_PER_POD, RESOURCE_BOUNDS, is_gpu, parse_quantity
from hvdgen.k8s.pods import containers, mapping, pod_specs
from hvdgen.k8s.problems import Problem


def resource_problems(job: dict) -> list[Problem]:
    problems = []
    for path, pod in pod_specs(job):
        for where, container in containers(pod, path):
            requests = mapping(container, "resources", "requests")
            limits = mapping(container, "resources", "limits")
            for part, amounts in (("requests", requests), ("limits", limits)):
                for name, value in amounts.items():
                    problems += _amount_problems(f"{where}.resources.{part}.{name}", name, value)
            problems += _over_limit(f"{where}.resources.requests", requests, limits)
    return problems


def _amount_problems(where: str, name, value) -> list[Problem]:
    amount = parse_quantity(value)
    if amount is None:
        return []  # the schemas name a malformed quantity
    if amount < 0:
        return [Problem(where, f"{value} is negative: give 0 or more")]
    if is_gpu(name):
        if amount != amount.to_integral_value():
            return [Problem(where, f"{value} is not a whole number of GPUs: give e.g. 1")]
        if amount > MAX_GPUS_PER_POD:
            return [Problem(where, f"{value} GPUs in one pod is more than any node holds (at most "
                                   f"{MAX_GPUS_PER_POD}): give GPUs per worker, and more workers")]
    elif name in RESOURCE_BOUNDS:
        bound, written = RESOURCE_BOUNDS[name]
        if amount > bound:
            return [Problem(where, f"{value} is more {name} than any node has (at most {written} per container): "
                                   "fix the number or its unit")]
    return []


def _over_limit(where: str, requests: dict, limits: dict) -> list[Problem]:
    """The API server refuses a request above its limit (and copies limits to missing requests)."""
    problems = []
    for name, value in requests.items():
        asked, most = parse_quantity(value), parse_quantity(limits.get(name))
        if asked is not None and most is not None and asked > most and not is_gpu(name) and most >= Decimal(0):
            problems.append(Problem(f"{where}.{name}", f"request {value} is above the limit {limits[name]}: make the "
                                    "request at most the limit"))
    return problems


def claim_problems(claim: dict) -> list[Problem]:
    """A PersistentVolumeClaim's size: more than nothing, at most what a provisioner grants."""
    value = mapping(claim, "spec", "resources", "requests").get("storage")
    size = parse_quantity(value)
    where = "spec.resources.requests.storage"
    if size is not None and size <= 0:
        return [Problem(where, f"{value} asks for no space: give e.g. 10Gi")]
    if size is not None and size > MAX_CLAIM:
        return [Problem(where, f"{value} is more than one volume holds (at most 64Ti): fix the number or its unit")]
    return []
