"""Checkpoints on disk: written atomically, keeping the last K; read newest-first.

Framework-free. A checkpoint is a file rank 0 writes (`ckpt-<step>.<suffix>`: the caller passes
how to write and read it), or a folder of shards every rank of the first replica writes into
(`ckpt-<step>/`, hvd_runtime.shards). A file goes to a temporary name in the same folder and is
renamed into place; a folder is written under a hidden name (`staging`) and renamed into place
once its index is in it (`publish`). Either way a job killed mid-write never leaves a
half-written checkpoint under a real name. If the newest still fails to load (a truncated copy,
a full disk), the previous one is used, with a warning.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hvd_runtime.write_failures import WriteFailures


@dataclass
class TrainState:
    """Where training stands: what a checkpoint must carry besides the weights to resume exactly."""

    epoch: int = 0              # the epoch in progress (or the next to run)
    step: int = 0               # batches trained so far, over all epochs
    samples_in_epoch: int = 0   # samples of this epoch's order already trained, over all ranks
    run_id: str | None = None   # the tracking run this training belongs to


@dataclass
class ElasticStart(TrainState):
    """Where an elastic job starts on this rank, before any collective.

    A worker that joins a running elastic job cannot take part in a start-up broadcast (the
    others are in their reset, about to sync), so elastic ranks broadcast nothing at start: rank
    0 loads its checkpoint alone, and the elastic state's first sync sends it to every rank, to
    late joiners too. `refusal` is why rank 0's checkpoint does not fit the model; the sync
    hands it to every rank, and all stop with it (a rank 0 stopping alone would leave the others
    training from scratch without it).
    """

    refusal: str | None = None


def state_fields(state) -> dict:
    """The TrainState fields of `state` (a TrainState, or Horovod's elastic state holding them)."""
    return {name: getattr(state, name) for name in TrainState.__dataclass_fields__}


_NAME = re.compile(r"ckpt-(\d{9})(?:\.(\w+))?$")
_STAGING = re.compile(r"\.ckpt-\d{9}\.(partial|old)$")


def newest_step(directory: str | Path) -> int | None:
    """The step of the newest checkpoint in `directory`, of either framework (None if there is none):
    how far a job has got, as a launcher outside it sees it (hvd_runtime.retry)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [int(m.group(1)) for p in directory.iterdir()
             if (m := _NAME.match(p.name)) and (m.group(2) is not None or (p / "index.json").is_file())]
    return max(steps, default=None)


class CheckpointStore:
    def __init__(self, directory: str | Path, keep: int = 3, is_writer: bool = True, suffix: str = "pt",
                 max_failures: int = 0):
        """`max_failures`: how many failed writes in a row the run goes on past (hvd_runtime.write_failures)."""
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.is_writer = is_writer
        self.suffix = suffix
        self.failures = WriteFailures(max_failures)

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:09d}.{self.suffix}"

    def folder_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:09d}"

    def paths(self) -> list[Path]:
        """Existing checkpoints, newest (highest step) first: files of this store's suffix, and
        folders holding an index (a sharded checkpoint's, the one of a step before its file)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), m.group(2) is None, p) for p in self.directory.iterdir()
                 if (m := _NAME.match(p.name)) and (m.group(2) == self.suffix or (m.group(2) is None
                                                                                  and (p / "index.json").is_file()))]
        return [p for *_, p in sorted(found, reverse=True)]

    def newest(self) -> Path | None:
        """The newest existing checkpoint (paths()'s first), or None."""
        found = self.paths()
        return found[0] if found else None

    def staging(self, step: int) -> Path:
        """An empty hidden folder for checkpoint `step`'s shards (the writer's; a leftover of an
        interrupted write, of this step or another, is removed first)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.iterdir():
            if _STAGING.match(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        folder = self.directory / f".{self.folder_for(step).name}.partial"
        folder.mkdir()
        return folder

    def publish(self, step: int, staging: Path) -> Path:
        """Rename a staged folder (its index written) into place, replacing a checkpoint of the
        same step, and prune to the last K. The writer's only."""
        final = self.folder_for(step)
        if final.exists():
            old = self.directory / f".{final.name}.old"
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.paths()[self.keep:]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def save(self, step: int, write: Callable[[Path], None]) -> Path | None:
        """Write checkpoint `step` with `write(tmp_path)`, rename it into place, prune old ones.

        Returns None on non-writer ranks, which never touch the disk.
        """
        if not self.is_writer:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=self.directory)
        os.close(fd)
        try:
            write(Path(tmp))
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._prune()
        return final

    def load_latest(self, read: Callable[[Path], Any]) -> tuple[Path, Any] | None:
        """`read` the newest checkpoint that loads; warn about each one that does not."""
        for path in self.paths():
            try:
                return path, read(path)
            except Exception as exc:  # a corrupt file can raise almost anything from the unpickler
                warnings.warn(f"checkpoint {path} could not be read ({type(exc).__name__}: {exc}); "
                              "falling back to the previous one", stacklevel=2)
        return None


def announce_resume(path: Path, payload: dict) -> None:
    """Rank 0's line on where a resumed run continues (the tests and the user both look for it)."""
    where = payload["state"]
    print(f"resuming from {path}: epoch {where['epoch']}, step {where['step']}", flush=True)


def misfit_message(detail: str) -> str:
    """The one line for a newest checkpoint that does not fit the model being trained (the data's
    classes or the model's sizes changed since it was written)."""
    return (f"the newest checkpoint holds a different model ({detail}): train into another folder with "
            "--checkpoint.dir DIR, or start over with --checkpoint.resume false")


def root_payload(hvd, store: "CheckpointStore", snapshot: Callable, rng_state: Callable, model, optimizer, state,
                 slices=None) -> dict | None:
    """Every rank calls: the payload rank 0 writes (None on the other ranks), either framework.

    Every rank's RNG state is gathered, and a tensor-parallel model's slices (`slices`) are gathered
    whole, which needs every rank; otherwise only the writer takes the snapshot. `hvd` is
    horovod.torch or horovod.tensorflow; `snapshot` and `rng_state` are the framework's.
    """
    rngs = hvd.allgather_object(rng_state(), name="rng_states")
    whole = snapshot(model, optimizer, state, rngs, slices=slices) if slices is not None else None
    if not store.is_writer:
        return None
    return whole or snapshot(model, optimizer, state, rngs)


def host_rng_state() -> dict:
    """This rank's Python and NumPy generator states as JSON values (a checkpoint's index is JSON)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def set_host_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
