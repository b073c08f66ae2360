"""Rank 0's record of a run: the resolved config and one JSON line of metrics per epoch.

Other ranks get a RunLog too, whose methods do nothing, so train.py needs no rank checks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from hvd_runtime.config import to_dict


class RunLog:
    def __init__(self, run_dir: str | Path, config, is_writer: bool):
        self.run_dir = Path(run_dir)
        self.config = config
        self.started = time.monotonic()
        self._is_writer = False
        self.is_writer = is_writer

    @property
    def is_writer(self) -> bool:
        return self._is_writer

    @is_writer.setter
    def is_writer(self, writer: bool) -> None:
        """Becoming the writer (at start, or as an elastic job's new rank 0) writes the run's config."""
        if writer and not self._is_writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.config), sort_keys=False))
        self._is_writer = writer

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> None:
        """Append one line to metrics.jsonl and print a one-line summary."""
        if not self.is_writer:
            return
        record = {"epoch": epoch, "step": step, "elapsed_s": round(time.monotonic() - self.started, 3), **metrics}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        summary = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        print(f"epoch {epoch:3d}  step {step:6d}  {summary}", flush=True)

    def info(self, message: str) -> None:
        if self.is_writer:
            print(message, flush=True)
