"""Validate a custom resource (MPIJob, TrainJob, TrainingRuntime, ClusterTrainingRuntime) against its
vendored CRD schema, made strict, and against the CRD's own CEL rules.

The API server prunes unknown fields of a custom resource without a word, so `limit:` for `limits:`
silently loses the limits. Adding `additionalProperties: false` wherever `properties` are listed
(what kubeconform's openapi2jsonschema does) turns that into an error we can name.
"""

from __future__ import annotations

import copy
import difflib
import json
from functools import lru_cache
from importlib import resources

from hvdgen.k8s.cel import cel_problems
from hvdgen.k8s.problems import Problem, field_path

SCHEMA_FILES = {  # kind -> the CRD's openAPIV3Schema, vendored unchanged (see data/PROVENANCE.md)
    "MPIJob": "mpijob_v2beta1.openapiv3.json",
    "TrainJob": "trainjob_v1alpha1.openapiv3.json",
    "TrainingRuntime": "trainingruntime_v1alpha1.openapiv3.json",
    "ClusterTrainingRuntime": "clustertrainingruntime_v1alpha1.openapiv3.json",
}
SCHEMA_FILE = SCHEMA_FILES["MPIJob"]


@lru_cache(maxsize=None)
def _schema_text(kind: str) -> str:
    return resources.files("hvdgen.k8s").joinpath("data", SCHEMA_FILES[kind]).read_text()


def load_schema(kind: str = "MPIJob") -> dict:
    """The CRD's openAPIV3Schema exactly as vendored (see data/PROVENANCE.md)."""
    return json.loads(_schema_text(kind))


@lru_cache(maxsize=None)
def _parsed_schema(kind: str) -> dict:
    """The CRD's schema, parsed once, for reading only (its CEL rules)."""
    return load_schema(kind)


def make_strict(schema: dict) -> dict:
    """A copy in which every object that lists its properties allows no others."""
    strict = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(strict)
    return strict


@lru_cache(maxsize=None)
def strict_validator(kind: str = "MPIJob"):
    import jsonschema  # noqa: PLC0415 - kept out of CLI start-up

    schema = make_strict(load_schema(kind))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _unknown_fields(error) -> list[Problem]:
    allowed = sorted(error.schema.get("properties", {}))
    where = field_path(error.absolute_path)
    problems = []
    for key in sorted(set(error.instance) - set(allowed)):
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        fix = f"did you mean '{close[0]}'?" if close else f"remove it (allowed here: {', '.join(allowed)})"
        problems.append(Problem(where, f"unknown field '{key}': {fix}"))
    return problems


_TYPE_EXAMPLES = {"integer": "a whole number such as 2, without quotes", "string": 'text, e.g. "value"',
                  "boolean": "true or false", "array": "a list", "object": "a mapping of fields"}


def _describe(error) -> str:
    kind = error.validator
    instance = error.instance
    value = type(instance).__name__ if isinstance(instance, (dict, list)) else json.dumps(instance)
    if kind == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"missing required field '{missing}': add it"
    if kind == "type":
        wanted = error.validator_value if isinstance(error.validator_value, str) else error.validator_value[0]
        return f"got {value}, expected {wanted}: write {_TYPE_EXAMPLES.get(wanted, wanted)}"
    if kind == "enum":
        allowed = [str(v) for v in error.validator_value if v != ""]  # "" stands for "left out"
        return f"{value} is not allowed: use {allowed[0] if len(allowed) == 1 else 'one of ' + ', '.join(allowed)}"
    if kind == "pattern" or (kind == "anyOf" and "x-kubernetes-int-or-string" in error.schema):
        return f"{value} is not a Kubernetes quantity: write e.g. 2, 500m, 4Gi or 16G"
    if kind in ("minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength"):
        return f"{value} is out of range ({kind} {error.validator_value}): change it"
    return f"{error.message}: fix this value"


def schema_problems(manifest: dict) -> list[Problem]:
    """Every violation of the strict CRD schema of the manifest's kind, one Problem per field, then
    the CRD's CEL rules where the schema found nothing."""
    kind = manifest.get("kind", "MPIJob")
    problems: list[Problem] = []
    for error in sorted(strict_validator(kind).iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path))):
        if error.validator == "additionalProperties" and error.validator_value is False:
            problems += _unknown_fields(error)
        else:
            problems.append(Problem(field_path(error.absolute_path), _describe(error)))
    return problems + [p for p in cel_problems(_parsed_schema(kind), manifest)
                       if not any(p.path.startswith(q.path) or q.path.startswith(p.path) for q in problems)]
