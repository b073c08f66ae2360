"""Read YAML manifests from a file or standard input; whatever cannot be read is one line that says so.

Users point `hvdgen k8s --check` at anything: a binary, a file in another encoding, a folder, a file
that is not there. Each is a ManifestError naming the file and what to give instead, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import yaml


class ManifestError(Exception):
    """A file that cannot be read as YAML manifests; the message is one line with the fix."""


def parse(text: str, name: str) -> list:
    """The non-empty YAML documents of `text`; a `kind: List` (what `kubectl get -o yaml` prints for
    several objects, and kustomize accepts) stands for its items."""
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        why = getattr(exc, "problem", None) or str(exc)
        raise ManifestError(" ".join(f"{name} is not valid YAML{where} ({why}): fix the indentation or quoting"
                                     .split())) from exc
    return [item for doc in documents for item in (_items(doc) if _is_list(doc) else [doc])]


def _is_list(doc) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == "List" and doc.get("apiVersion") == "v1"


def _items(doc: dict) -> list:
    items = doc.get("items")
    return [item for item in items if item is not None] if isinstance(items, list) else []


def decode(data: bytes, name: str) -> str:
    if b"\0" in data:
        raise ManifestError(f"{name} is a binary file, not YAML: give a manifest such as k8s/base/mpijob.yaml")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{name} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from exc


def load(path: Path, name: str | None = None) -> list:
    """The documents of the file at `path`, called `name` in messages (default: the file's name)."""
    name = name or path.name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read {name} ({exc.strerror}): give a readable manifest file") from exc
    return parse(decode(data, name), name)
