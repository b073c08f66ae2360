"""Kubernetes names. Every pod name derived from the job's must be a DNS-1035 label: the MPI operator
names worker pods `<job>-worker-<i>`; the Trainer's JobSet names them `<job>-<replicated job>-0-<i>`
(`<job>-launcher-0-0`, `<job>-node-0-<i>`)."""

from __future__ import annotations

import re

DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_LABEL = 63


def is_dns1035_label(value: str) -> bool:
    return isinstance(value, str) and len(value) <= MAX_LABEL and DNS1035_LABEL.fullmatch(value) is not None


def last_worker_name(job_name: str, workers: int) -> str:
    """The longest pod name the MPI operator derives from the job name."""
    return f"{job_name}-worker-{max(workers, 1) - 1}"


def longest_pod_name(job_name: str, workers: int, api: str = "mpijob") -> str:
    """The longest pod name the operator (`api` mpijob) or the Trainer (`api` trainer) derives from the job name."""
    if api == "trainer":
        return max(f"{job_name}-launcher-0-0", f"{job_name}-node-0-{max(workers, 1) - 1}", key=len)
    return last_worker_name(job_name, workers)


def max_job_name_length(workers: int, api: str = "mpijob") -> int:
    return MAX_LABEL - len(longest_pod_name("", workers, api))


def job_name(project_name: str, workers: int, api: str = "mpijob") -> str:
    """The job's name for a project: lower case, '-' for other characters, short enough for every pod."""
    name = re.sub(r"[^a-z0-9-]+", "-", project_name.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)
    if not name or not name[0].isalpha():
        name = f"job-{name}".rstrip("-")
    return name[:max_job_name_length(workers, api)].rstrip("-")


def dns1035_fix(value: str, workers: int, api: str = "mpijob") -> str:
    """A suggestion that satisfies the rule, for error messages."""
    return job_name(value or "job", workers, api)
