"""The CEL rules of a CRD (`x-kubernetes-validations`), checked as the API server checks them on create.

The OpenAPI part of a schema misses them: a TrainJob's `numProcPerNode >= 1`, "only one ML policy"
in a runtime, a TrainJob name that is an RFC 1035 label. cel-python evaluates each rule with `self`
bound to the value where the rule sits. Rules that compare with `oldSelf` are transition rules (a
field that may not change after creation); they apply to updates only, so they are skipped here. A
rule that cannot be evaluated (it reads a field the object leaves out) is left to the schema, which
names missing required fields itself.
"""

from __future__ import annotations

import json
import re
from functools import cache

from hvdgen.k8s.problems import Problem, field_path


def cel_problems(schema: dict, instance) -> list[Problem]:
    """One Problem per CEL rule of a CRD's `schema` that `instance` breaks, at the field that holds the rule."""
    problems: list[Problem] = []
    _walk(schema, instance, [], problems)
    return problems


def _walk(node: dict, value, path: list, problems: list[Problem]) -> None:
    if value is None or not isinstance(node, dict):
        return
    for rule in node.get("x-kubernetes-validations") or []:
        if "oldSelf" in rule.get("rule", "") or _holds(rule["rule"], value) is not False:
            continue
        problems.append(Problem(field_path(path + _field_of(rule["rule"])),
                                f"{rule.get('message') or rule['rule']}: fix this value"))
    if isinstance(value, dict):
        properties = node.get("properties") or {}
        others = node.get("additionalProperties")
        for key, item in value.items():
            child = properties.get(key, others if isinstance(others, dict) else None)
            if child is not None:
                _walk(child, item, path + [key], problems)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            _walk(node["items"], item, path + [i], problems)


_REFERENCE = re.compile(r"self((?:\.[A-Za-z_]\w*)+)")
_METHODS = {"matches", "size", "exists", "all", "filter", "startsWith", "endsWith", "contains", "map"}


def _field_of(rule: str) -> list[str]:
    """The one field below `self` that a rule reads, if it reads only one (`self.metadata.name.matches(...)`
    and `size(self.metadata.name) <= 63`: metadata.name), so the message points at it; else none."""
    fields = set()
    for reference in _REFERENCE.findall(rule):
        parts = reference.strip(".").split(".")
        while parts and parts[-1] in _METHODS:
            parts.pop()
        fields.add(tuple(parts))
    return list(fields.pop()) if len(fields) == 1 else []


def _holds(rule: str, value) -> bool | None:
    """True or False as the rule says, None when it cannot be evaluated on this value."""
    import celpy  # noqa: PLC0415 - the CEL interpreter loads only when validating

    try:
        result = _program(rule).evaluate({"self": celpy.json_to_cel(json.loads(json.dumps(value)))})
    except Exception:  # noqa: BLE001 - cel-python raises its own error types for fields a value lacks
        return None
    return bool(result) if isinstance(result, celpy.celtypes.BoolType) else None


@cache
def _program(rule: str):
    environment = _environment()
    return environment.program(environment.compile(rule))


@cache
def _environment():
    import celpy  # noqa: PLC0415

    return celpy.Environment()
