"""Check core Kubernetes objects, and the MPIJob's pod templates, against the Kubernetes schemas.

The `kubernetes-validate` package ships the JSON schemas of every Kubernetes release, so this works
offline. A pod template is checked by wrapping it in a `PodTemplate` object, the core type that
holds exactly one `template`.
"""

from __future__ import annotations

from hvdgen.k8s.problems import Problem, field_path

KUBERNETES_VERSION = "1.33"  # oldest release the manifests must work on; its schema is the strictest
CORE_KINDS = {("v1", "PersistentVolumeClaim"), ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "PodTemplate")}


def core_problems(obj: dict, prefix: tuple = ()) -> list[Problem]:
    """The first violation of the strict Kubernetes schema for `obj`, if any, as a Problem."""
    import kubernetes_validate  # noqa: PLC0415 - large schema package, loaded only when validating

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = field_path(list(prefix) + list(error.path))
        if error.validator == "additionalProperties":
            return [Problem(where, f"{error.message}: remove or correct the field")]
        if error.validator == "required":
            return [Problem(where, f"{error.message}: add it")]
        return [Problem(where, f"{error.message}: fix this value")]
    return []


def pod_template_problems(template: dict, path: str) -> list[Problem]:
    """`path` is where the template sits in the MPIJob, so messages point into the user's file."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    problems = core_problems(wrapped)
    return [Problem(p.path.replace("template", path, 1), p.message) for p in problems]
