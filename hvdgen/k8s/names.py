"""Kubernetes names. The operator names worker pods `<job>-worker-<i>`; each must be a DNS-1035 label."""

from __future__ import annotations

import re

DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_LABEL = 63


def is_dns1035_label(value: str) -> bool:
    return isinstance(value, str) and len(value) <= MAX_LABEL and DNS1035_LABEL.fullmatch(value) is not None


def last_worker_name(job_name: str, workers: int) -> str:
    """The longest pod name the operator derives from the job name."""
    return f"{job_name}-worker-{max(workers, 1) - 1}"


def max_job_name_length(workers: int) -> int:
    return MAX_LABEL - len(last_worker_name("", workers))


def job_name(project_name: str, workers: int) -> str:
    """The MPIJob name for a project: lower case, '-' for other characters, short enough for every worker."""
    name = re.sub(r"[^a-z0-9-]+", "-", project_name.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)
    if not name or not name[0].isalpha():
        name = f"job-{name}".rstrip("-")
    return name[:max_job_name_length(workers)].rstrip("-")


def dns1035_fix(value: str, workers: int) -> str:
    """A suggestion that satisfies the rule, for error messages."""
    return job_name(value or "job", workers)
