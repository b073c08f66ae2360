"""What identifies a run: the resolved config plus the facts needed to reproduce it."""

from __future__ import annotations

import getpass
import importlib.metadata
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

from hvd_runtime.config import flatten

MAX_PARAM_CHARS = 6000  # MLflow's limit on one param value

# param name -> distributions that provide it; read from metadata so no framework is imported
VERSIONED = {
    "horovod_version": ("horovod",),
    "torch_version": ("torch",),
    "tensorflow_version": ("tensorflow", "tensorflow-cpu", "tensorflow-macos"),
    "mlflow_version": ("mlflow", "mlflow-skinny"),
}


def redact(text: str) -> str:
    """Drop a password from a URL, so a URI carrying credentials is never logged as a param."""
    if "://" not in text or "@" not in text:
        return text
    parts = urlsplit(text)
    if parts.password is None:
        return text
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def package_version(distributions: tuple[str, ...]) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def git_commit(cwd=None) -> str | None:
    """HEAD of the repository holding cwd, or None outside one (or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def _text(value) -> str:
    text = redact(value if isinstance(value, str) else str(value))
    return text[:MAX_PARAM_CHARS]


def run_params(config, *, world_size: int, strategy: str, framework: str, cwd=None) -> dict[str, str]:
    params = {key: _text(value) for key, value in flatten(config).items()}
    params.update(world_size=str(world_size), strategy=strategy, framework=framework)
    for key, distributions in VERSIONED.items():
        version = package_version(distributions)
        if version:
            params[key] = version
    commit = git_commit(cwd)
    if commit:
        params["git_commit"] = commit
    return params


def run_tags(params: dict[str, str]) -> dict[str, str]:
    """MLflow's own source tags, so the UI shows the script, user and commit as for any run."""
    tags = {"mlflow.source.name": sys.argv[0] or "python", "mlflow.source.type": "LOCAL"}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # no user database entry, e.g. an arbitrary uid in a container
        pass
    if "git_commit" in params:
        tags["mlflow.source.git.commit"] = params["git_commit"]
    return tags
