"""Tracking records: plain dicts, the one currency of the sender, the spool and replay.

kinds: run (spool header), params, metrics, tags, artifact, model, end. All but an in-memory
model record are JSON as they are; `group` batches consecutive metrics into one request.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    return int(time.time() * 1000)


def metrics(values: dict, step: int) -> dict:
    return {"kind": "metrics", "metrics": {str(k): float(v) for k, v in values.items()},
            "step": int(step), "timestamp": now_ms()}


def tags(values: dict) -> dict:
    return {"kind": "tags", "tags": {str(k): str(v) for k, v in values.items()}}


def params(values: dict) -> dict:
    return {"kind": "params", "params": dict(values)}


def artifact(path: str, artifact_path: str | None = None) -> dict:
    return {"kind": "artifact", "path": path, "artifact_path": artifact_path}


def end(status: str) -> dict:
    return {"kind": "end", "status": status, "end_time": now_ms()}


def group(records: list[dict], max_metrics: int = 1000) -> list[list[dict]]:
    """Consecutive metrics records become one group (one log_batch); anything else stands alone."""
    groups: list[list[dict]] = []
    size = 0
    for record in records:
        n = len(record.get("metrics", ()))
        if (record["kind"] == "metrics" and groups and groups[-1][0]["kind"] == "metrics"
                and size + n <= max_metrics):
            groups[-1].append(record)
            size += n
        else:
            groups.append([record])
            size = n
    return groups
