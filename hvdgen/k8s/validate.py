"""Validate Kubernetes objects: the MPIJob, or the TrainJob and its runtime, in several passes, core
objects against their schemas, and a set of documents as one job."""

from __future__ import annotations

from hvdgen.k8s.core import CORE_KINDS, core_problems, pod_template_problems
from hvdgen.k8s.env_secrets import configmap_problems, env_problems
from hvdgen.k8s import trainjob
from hvdgen.k8s.mpijob import API_VERSION, KIND
from hvdgen.k8s.pods import pod_templates
from hvdgen.k8s.problems import Problem
from hvdgen.k8s.resources import claim_problems, resource_problems
from hvdgen.k8s.rules import REPLICA_TYPES, convention_problems, operator_problems
from hvdgen.k8s.schema import schema_problems
from hvdgen.k8s.security import security_problems
from hvdgen.k8s.trainer_rules import pair_problems, runtime_problems, trainjob_problems

EXAMPLE = "give the job's manifest, e.g. k8s/base/mpijob.yaml or `kubectl kustomize k8s/overlays/gpu`"
JOB_KINDS = (KIND, trainjob.TRAINJOB, *trainjob.RUNTIME_KINDS)


def mpijob_problems(job: dict) -> list[Problem]:
    """Strict CRD schema, the operator's rules, Horovod conventions, pod security, credentials and
    resource bounds, then the pod templates against the core schema.

    A pod template is checked against the core schema only when nothing else was found in it, so one
    mistake is reported once.
    """
    problems = schema_problems(job)
    problems += operator_problems(job)
    problems += convention_problems(job)
    problems += security_problems(job)
    problems += env_problems(job)
    problems += resource_problems(job)
    specs = (job.get("spec") or {}).get("mpiReplicaSpecs") if isinstance(job.get("spec"), dict) else None
    for kind in REPLICA_TYPES:
        template = specs.get(kind, {}).get("template") if isinstance(specs, dict) and isinstance(
            specs.get(kind), dict) else None
        path = f"spec.mpiReplicaSpecs.{kind}.template"
        if isinstance(template, dict) and not any(p.path.startswith(path) for p in problems):
            problems += pod_template_problems(template, path)
    return _unique(problems)


def trainer_problems(obj: dict) -> list[Problem]:
    """A TrainJob, TrainingRuntime or ClusterTrainingRuntime: strict CRD schema and CEL rules, the
    Trainer's and Horovod's rules, and a runtime's pods as an MPIJob's (security, credentials,
    resources, core schema)."""
    if obj["kind"] == trainjob.TRAINJOB:
        rules = trainjob_problems(obj)
    else:
        rules = runtime_problems(obj) + security_problems(obj) + env_problems(obj) + resource_problems(obj)
    # A rule's message names the fix for its field; the schema's finding at the same field is dropped,
    # and a rule's finding about a field the schema found wrong inside is dropped.
    schema = [p for p in schema_problems(obj) if not any(r.path == p.path for r in rules)]
    problems = schema + [r for r in rules if not any(p.path.startswith(r.path) for p in schema)]
    for path, template in pod_templates(obj):
        if not any(p.path.startswith(path) for p in problems):
            problems += pod_template_problems(template, path)
    return _unique(problems)


def is_object(doc) -> bool:
    """A Kubernetes object names its apiVersion and kind."""
    return isinstance(doc, dict) and isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str)


def object_problems(obj) -> list[Problem]:
    """Problems of one parsed YAML document; kinds hvdgen does not know are left alone."""
    if not isinstance(obj, dict):
        return [Problem("", f"a document is a {type(obj).__name__}, not a Kubernetes object: {EXAMPLE}")]
    if not is_object(obj):
        missing = [key for key in ("apiVersion", "kind") if not isinstance(obj.get(key), str)]
        if len(missing) == 2:
            return [Problem("", f"a document has no apiVersion and kind, so it is not a Kubernetes object: {EXAMPLE}")]
        return [Problem(missing[0], "missing: add it (an MPIJob has apiVersion: kubeflow.org/v2beta1, "
                                    "kind: MPIJob)")]
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if kind == KIND:
        if api_version != API_VERSION:
            return [Problem("apiVersion", f"{api_version!r} is not served by the MPI operator v2: "
                                          f"use apiVersion: {API_VERSION}")]
        return mpijob_problems(obj)
    if kind in (trainjob.TRAINJOB, *trainjob.RUNTIME_KINDS):
        if api_version != trainjob.API_VERSION:
            return [Problem("apiVersion", f"{api_version!r} is not served by Kubeflow Trainer v2: "
                                          f"use apiVersion: {trainjob.API_VERSION}")]
        return trainer_problems(obj)
    if (api_version, kind) in CORE_KINDS:
        problems = core_problems(obj)
        if kind == "ConfigMap":
            problems += configmap_problems(obj)
        if kind == "PersistentVolumeClaim":
            problems += claim_problems(obj)
        return problems
    return []


def job_problems(documents: list) -> list[Problem]:
    """Documents applied together must hold the job; reported only when each is a Kubernetes object,
    so a file that is not a manifest at all is named once."""
    if not documents:
        return [Problem("", f"holds no Kubernetes object: {EXAMPLE}")]
    if all(is_object(doc) for doc in documents) and not any(doc["kind"] in JOB_KINDS for doc in documents):
        kinds = ", ".join(sorted({doc["kind"] for doc in documents}))
        return [Problem("", f"holds no MPIJob or TrainJob (only {kinds}): {EXAMPLE}")]
    return []


def documents_problems(documents: list) -> list[Problem]:
    """Each document's problems, then those of the documents as one job (a TrainJob against its runtime)."""
    problems = [p for doc in documents for p in object_problems(doc)]
    for doc in documents:
        if is_object(doc) and doc["kind"] == trainjob.TRAINJOB and doc["apiVersion"] == trainjob.API_VERSION:
            problems += [p for p in pair_problems(doc, documents) if p not in problems]
    return problems + job_problems(documents)


def _unique(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for problem in problems:
        if (problem.path, problem.message) not in seen:
            seen.add((problem.path, problem.message))
            out.append(problem)
    return out
