"""Validate Kubernetes objects: the MPIJob in three passes, core objects against their schemas."""

from __future__ import annotations

from hvdgen.k8s.core import CORE_KINDS, core_problems, pod_template_problems
from hvdgen.k8s.mpijob import API_VERSION, KIND
from hvdgen.k8s.problems import Problem
from hvdgen.k8s.rules import REPLICA_TYPES, convention_problems, operator_problems
from hvdgen.k8s.schema import schema_problems


def mpijob_problems(job: dict) -> list[Problem]:
    """Strict CRD schema, then the operator's rules and Horovod conventions, then the pod templates.

    A pod template is checked against the core schema only when the CRD schema found nothing in it,
    so one mistake is reported once.
    """
    problems = schema_problems(job)
    problems += operator_problems(job)
    problems += convention_problems(job)
    specs = (job.get("spec") or {}).get("mpiReplicaSpecs")
    for kind in REPLICA_TYPES:
        template = specs.get(kind, {}).get("template") if isinstance(specs, dict) and isinstance(
            specs.get(kind), dict) else None
        path = f"spec.mpiReplicaSpecs.{kind}.template"
        if isinstance(template, dict) and not any(p.path.startswith(path) for p in problems):
            problems += pod_template_problems(template, path)
    return _unique(problems)


def object_problems(obj) -> list[Problem]:
    """Problems of one parsed YAML document; kinds hvdgen does not know are left alone."""
    if not isinstance(obj, dict):
        return [Problem("(document)", "is not a mapping: a manifest starts with apiVersion, kind and metadata")]
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if kind == KIND:
        if api_version != API_VERSION:
            return [Problem("apiVersion", f"{api_version!r} is not served by the MPI operator v2: "
                                          f"use apiVersion: {API_VERSION}")]
        return mpijob_problems(obj)
    if (api_version, kind) in CORE_KINDS:
        return core_problems(obj)
    return []


def _unique(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for problem in problems:
        if (problem.path, problem.message) not in seen:
            seen.add((problem.path, problem.message))
            out.append(problem)
    return out
