"""Credentials written into a manifest: they belong in a Secret, read through `valueFrom.secretKeyRef`.

A literal `value:` ends up in version control and in `kubectl get mpijob -o yaml` for everyone who
may read jobs in the namespace; a ConfigMap is readable the same way. A value is taken for a
credential when its name says so (a word of the name ending in PASSWORD, SECRET, TOKEN, KEY or
CREDENTIALS, such as AWS_SECRET_ACCESS_KEY or MLFLOW_TRACKING_TOKEN, or a known credential such as
MLFLOW_TRACKING_USERNAME), or when the value itself is one whatever its name: a URL with a password,
a private key, an AWS access key id. An absolute path (a mounted key file) or a `$(VAR)` reference is
not a credential.
"""

from __future__ import annotations

import re

from hvdgen.k8s.pods import containers, mapping, pod_specs
from hvdgen.k8s.problems import Problem

_SECRET_WORD = re.compile(r"(PASSWORD|PASSWD|PASSPHRASE|SECRETS?|TOKEN|KEY|CREDENTIALS?)$|^PASS$")
CREDENTIAL_NAMES = frozenset({"MLFLOW_TRACKING_USERNAME", "AZURE_STORAGE_CONNECTION_STRING"})
_URL_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@", re.IGNORECASE)
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b")
_REFERENCE = re.compile(r"\$\([A-Za-z_][A-Za-z0-9_.-]*\)")


def is_credential_name(name) -> bool:
    """AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD, hfToken: yes. TOKENIZERS_PARALLELISM, NCCL_DEBUG: no."""
    if not isinstance(name, str):
        return False
    upper = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).upper()
    return upper in CREDENTIAL_NAMES or any(_SECRET_WORD.search(word) for word in re.split(r"[^A-Z0-9]+", upper))


def literal_credential(name, value) -> str | None:
    """Why `name: value`, written as is, exposes a credential; None when it does not."""
    if not isinstance(value, str) or not value.strip() or _REFERENCE.fullmatch(value.strip()):
        return None
    if _URL_PASSWORD.search(value):
        return "holds a password inside a URL"
    if _PRIVATE_KEY.search(value):
        return "holds a private key"
    if _AWS_KEY_ID.search(value):
        return "holds an AWS access key id"
    if is_credential_name(name) and not value.startswith("/"):
        return "is a credential written into the manifest"
    return None


def env_problems(job: dict) -> list[Problem]:
    """Literal credentials in the job's container environments, and credentials read from ConfigMaps."""
    return [problem for path, pod in pod_specs(job) for where, container in containers(pod, path)
            for problem in env_list_problems(container.get("env"), f"{where}.env")]


def env_list_problems(env, where: str) -> list[Problem]:
    """The same for one `env:` list (a container's, or a TrainJob's spec.trainer.env) at `where`."""
    problems = []
    for i, entry in enumerate(env if isinstance(env, list) else []):
        if not isinstance(entry, dict):
            continue
        name = entry.get("name")
        reason = literal_credential(name, entry.get("value"))
        if reason:
            problems.append(Problem(f"{where}[{i}].value", f"{name} {reason}: store it in a Secret "
                                    f"(kubectl create secret generic NAME --from-literal={name}=...) "
                                    "and read it with valueFrom.secretKeyRef"))
        elif mapping(entry, "valueFrom", "configMapKeyRef") and is_credential_name(name):
            problems.append(Problem(f"{where}[{i}].valueFrom.configMapKeyRef",
                                    f"{name} is a credential read from a ConfigMap: store it in a Secret "
                                    "and read it with secretKeyRef"))
    return problems


def configmap_problems(config_map: dict) -> list[Problem]:
    """Credentials stored in a ConfigMap's data."""
    return [Problem(f"data.{key}", f"{key} {reason}: keep it in a Secret instead of a ConfigMap")
            for key, value in mapping(config_map, "data").items()
            if (reason := literal_credential(key, value))]
