"""Kustomize: the layout hvdgen writes, and a small renderer for checking it without kubectl.

For a custom resource such as MPIJob, kustomize has no merge keys, so a patch is a JSON merge
patch (RFC 7386): mappings merge, lists are replaced whole. The renderer here implements that and
the few kustomization fields hvdgen writes (resources, patches, namespace, images); the tests check
it against `kubectl kustomize`. Anything else is reported, never ignored.
"""

from __future__ import annotations

import copy
from pathlib import Path

from hvdgen.k8s.documents import ManifestError, load, parse

KUSTOMIZATION = "kustomization.yaml"
KUSTOMIZE_API = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
SUPPORTED = {"apiVersion", "kind", "resources", "patches", "patchesStrategicMerge", "namespace", "images"}


class RenderError(ManifestError):
    """A kustomization this renderer cannot follow; the message says what to do instead."""


def merge_patch(target, patch):
    """RFC 7386: apply `patch` to `target` (neither is modified)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def diff_patch(old: dict, new: dict) -> dict:
    """The smallest merge patch that turns `old` into `new`."""
    patch = {}
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(old[key], dict):
            sub = diff_patch(old[key], value)
            if sub:
                patch[key] = sub
        elif value != old[key]:
            patch[key] = copy.deepcopy(value)
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


def identity(obj: dict) -> tuple:
    """What a patch must share with its target: kind, name, and namespace (unset means "default")."""
    metadata = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return obj.get("kind"), metadata.get("name"), metadata.get("namespace") or "default"


def overlay_patch(base: dict, variant: dict) -> dict:
    """A patch file: the object's identity plus what differs."""
    patch = diff_patch(base, variant)
    metadata = {key: base["metadata"][key] for key in ("name", "namespace") if key in base["metadata"]}
    metadata.update(patch.pop("metadata", {}))
    return {"apiVersion": base["apiVersion"], "kind": base["kind"], "metadata": metadata, **patch}


def load_documents(path: Path) -> list:
    """The documents of one file; raises ManifestError (one line) for anything unreadable."""
    return load(path)


def _strings(config: dict, key: str) -> list[str]:
    value = config.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RenderError(f"{KUSTOMIZATION}: {key} must be a list of paths: fix it")
    return value


def _image_name(image: str) -> str:
    image = image.split("@", 1)[0]
    last = image.rsplit("/", 1)[-1]
    return image.rsplit(":", 1)[0] if ":" in last else image


def _set_images(obj: dict, images: list[dict]) -> None:
    def visit(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for container in value:
                        if isinstance(container, dict) and isinstance(container.get("image"), str):
                            container["image"] = _new_image(container["image"], images)
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(obj)


def _new_image(image: str, images: list[dict]) -> str:
    for rule in images:
        if rule.get("name") == _image_name(image):
            name = rule.get("newName", rule["name"])
            if rule.get("digest"):
                return f"{name}@{rule['digest']}"
            tag = rule.get("newTag") or (image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else None)
            return f"{name}:{tag}" if tag else name
    return image


def render(directory: Path, _inside: tuple[Path, ...] = ()) -> list[dict]:
    """The objects `kubectl kustomize directory` would print, for the fields hvdgen writes."""
    if directory.resolve() in _inside:
        raise RenderError(f"{directory} includes itself through its resources: remove the loop")
    inside = _inside + (directory.resolve(),)
    docs = load_documents(directory / KUSTOMIZATION)
    config = docs[0] if docs and isinstance(docs[0], dict) else {}
    instead = f"run `kubectl kustomize {directory} | hvdgen k8s --check --file -` instead"
    unknown = sorted(map(str, set(config) - SUPPORTED))
    if unknown:
        raise RenderError(f"field(s) {', '.join(unknown)} are not followed by hvdgen's checker: {instead}")
    objects: list[dict] = []
    for entry in _strings(config, "resources"):
        path = directory / entry
        if path.is_dir():
            objects += render(path, inside)
        elif path.is_file():
            objects += load_documents(path)
        else:
            raise RenderError(f"resource {entry!r} does not exist: fix the path")
    patches = [{"path": p} for p in _strings(config, "patchesStrategicMerge")] + list(config.get("patches") or [])
    for entry in patches:
        if (not isinstance(entry, dict) or "target" in entry or ("path" not in entry and "patch" not in entry)
                or not isinstance(entry.get("path", entry.get("patch")), str)):
            raise RenderError(f"patch {entry!r} is not a plain merge patch: {instead}")
        docs = load_documents(directory / entry["path"]) if "path" in entry else parse(entry["patch"],
                                                                                       "an inline patch")
        for doc in docs:
            if not isinstance(doc, dict):
                raise RenderError(f"patch {entry!r} is a JSON 6902 patch: {instead}")
            matches = [i for i, obj in enumerate(objects) if isinstance(obj, dict) and identity(obj) == identity(doc)]
            if not matches:
                kind, name, namespace = identity(doc)
                raise RenderError(f"patch for {kind} {name!r} in namespace {namespace!r} matches no resource: "
                                  "make its kind, metadata.name and metadata.namespace match the base")
            for i in matches:
                objects[i] = merge_patch(objects[i], doc)
    images = config.get("images") or []
    if not isinstance(images, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in images):
        raise RenderError(f"{KUSTOMIZATION}: images must be a list of mappings with a name: fix it")
    for obj in objects:
        if not isinstance(obj, dict):
            continue
        if config.get("namespace"):
            if not isinstance(obj.get("metadata", {}), dict):
                continue  # the object's own check names its broken metadata
            obj.setdefault("metadata", {})["namespace"] = config["namespace"]
        if images:
            _set_images(obj, images)
    return objects


def kustomization(resources: list[str], namespace: str | None = None, patches: list[str] = ()) -> dict:
    out = dict(KUSTOMIZE_API)
    if namespace:
        out["namespace"] = namespace
    out["resources"] = list(resources)
    if patches:
        out["patches"] = [{"path": p} for p in patches]
    return out

