"""Check core Kubernetes objects, and the MPIJob's pod templates, against the Kubernetes schemas.

The `kubernetes-validate` package ships the JSON schemas of every Kubernetes release, so this works
offline. A pod template is checked by wrapping it in a `PodTemplate` object, the core type that
holds exactly one `template`.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources

from hvdgen.k8s.problems import Problem, field_path

KUBERNETES_VERSION = "1.33"  # oldest release the manifests must work on; its schema is the strictest
CORE_KINDS = {("v1", "PersistentVolumeClaim"), ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "PodTemplate")}


def core_problems(obj: dict, prefix: tuple = ()) -> list[Problem]:
    """The first violation of the strict Kubernetes schema for `obj`, if any, as a Problem."""
    from jsonschema.exceptions import best_match  # noqa: PLC0415 - kept out of CLI start-up

    error = best_match(_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj))  # what validate() raises
    if error is None:
        return []
    where = field_path(list(prefix) + list(error.path))
    if error.validator == "additionalProperties":
        return [Problem(where, f"{error.message}: remove or correct the field")]
    if error.validator == "required":
        return [Problem(where, f"{error.message}: add it")]
    return [Problem(where, f"{error.message}: fix this value")]


@cache
def _validator(api_version: str, kind: str):
    """The validator `kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)` builds, built
    once per kind instead of once per call (each call re-reads the 1 MB definitions file)."""
    import jsonschema  # noqa: PLC0415 - large schema packages, loaded only when validating
    import referencing

    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{KUBERNETES_VERSION}.0-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # rbac.authorization.k8s.io/v1 -> rbac-v1
    schema = json.loads(folder.joinpath(f"{kind.lower()}-{group}.json").read_text())
    definitions = json.loads(folder.joinpath("_definitions.json").read_text())
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def pod_template_problems(template: dict, path: str) -> list[Problem]:
    """`path` is where the template sits in the MPIJob, so messages point into the user's file."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    problems = core_problems(wrapped)
    return [Problem(p.path.replace("template", path, 1), p.message) for p in problems]
