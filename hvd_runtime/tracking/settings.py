"""Where tracking goes and how long a request may wait, decided once on rank 0 before MLflow loads."""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_DB = "mlflow.db"
SPOOL_DIRNAME = "mlflow-spool"

# MLflow's own defaults retry for minutes (7 retries, 120 s timeout): right for a notebook, wrong
# for a sender that should notice a dead server quickly and spool. Set only where the user has not.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",       # per socket wait, not per transfer: uploads may take longer
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
}


def embedded_uri(cwd: str | Path | None = None) -> str:
    """sqlite:///<cwd>/mlflow.db, absolute so a later chdir cannot split the store in two."""
    return f"sqlite:///{Path(cwd or os.getcwd()).resolve() / EMBEDDED_DB}"


def resolve_uri(explicit: str | None, config, cwd: str | Path | None = None) -> str:
    """Argument > MLFLOW_TRACKING_URI > config tracking.uri > embedded sqlite store.

    The environment beats the config file because that is how a deployment (a Kubernetes
    ConfigMap or Secret) points an image that was built with a project config at its server.
    """
    section = getattr(config, "tracking", None)
    for candidate in (explicit, os.environ.get("MLFLOW_TRACKING_URI"), getattr(section, "uri", "")):
        if candidate:
            return candidate
    return embedded_uri(cwd)


def experiment_name(config, project_name: str) -> str:
    section = getattr(config, "tracking", None)
    return getattr(section, "experiment", "") or project_name


def enabled(config) -> bool:
    section = getattr(config, "tracking", None)
    return bool(getattr(section, "enabled", True))


def checkpoint_models(config) -> str:
    section = getattr(config, "tracking", None)
    return getattr(section, "checkpoint_models", "auto") or "auto"


def spool_dir(config) -> Path:
    """<run_dir>/mlflow-spool: beside the run's other local records, so it travels with them."""
    return Path(getattr(config, "run_dir", ".") or ".").resolve() / SPOOL_DIRNAME


def apply_http_defaults(environ=os.environ) -> None:
    for key, value in HTTP_DEFAULTS.items():
        environ.setdefault(key, value)
