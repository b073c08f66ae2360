"""The local spool: what could not be sent, kept as JSON lines beside the run, replayable later.

Each process that spools starts a segment with a `run` line (experiment, run id if known, name,
tags) and a `params` line, so a segment alone can recreate its run on any server. Artifacts are
copied into the spool directory and models saved there, with paths stored relative to it, so the
directory can be copied off a node or pod and replayed elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterator

SPOOL_FILE = "spool.jsonl"


class Spool:
    def __init__(self, directory: Path, segment_head: Callable[[], list[dict]]):
        self.directory = Path(directory)
        self.path = self.directory / SPOOL_FILE
        self._segment_head = segment_head
        self._lock = threading.Lock()
        self._started = False
        self.count = 0      # records written by this process, the head excluded

    def new_slot(self, name: str) -> Path:
        """A fresh directory inside the spool for one artifact or model."""
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            n = sum(1 for _ in self.directory.glob("item-*"))
            while (slot := self.directory / f"item-{n:04d}").exists():
                n += 1
            slot.mkdir()
        return slot / name

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        lines = [json.dumps(self._portable(r)) for r in records]
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                if not self._started:
                    f.writelines(json.dumps(r) + "\n" for r in self._segment_head())
                    self._started = True
                f.writelines(line + "\n" for line in lines)
                f.flush()
                os.fsync(f.fileno())
            self.count += len(records)

    def _portable(self, record: dict) -> dict:
        """Artifacts are copied in now: the original may be rotated away (keep-K) before a replay."""
        if record["kind"] != "artifact":
            return record
        source = Path(record["path"])
        if not source.exists():
            return {**record, "missing": True}
        target = self.new_slot(source.name)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        return {**record, "path": str(target.relative_to(self.directory))}


def read_segments(path: Path) -> Iterator[tuple[dict, list[dict]]]:
    """(run header, records) for each segment of a spool file."""
    header, records = None, []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if record["kind"] == "run":
                if header is not None:
                    yield header, records
                header, records = record, []
            elif header is not None:
                records.append(record)
    if header is not None:
        yield header, records
