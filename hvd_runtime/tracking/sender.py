"""One background sender per run, so the training loop never waits on the network or on MLflow.

Why a thread rather than only short HTTP timeouts: even a 5 s timeout, retried, would stall
every step while a server is down or slow, and the first contact with a fresh sqlite store
spends seconds on migrations. So the training thread only enqueues (never blocking: a full queue
spools instead), and this thread sends in order, consecutive metrics batched into one request.
The first failure prints one warning; from then on every record goes to the local spool, which
is fast and cannot fail the job. `Tracker.close` waits for this thread at most a fixed time and
then spools whatever is left, so the job's exit is bounded whatever the server does. MLflow
itself runs in a process of its own that this thread talks to (remote.py): its Python would
otherwise take turns with training's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from . import records
from .remote import MLFLOW_IMPORT, RemoteSink
from .spool import Spool

MAX_BATCH = 500     # records taken from the queue per round trip
# MLflow error codes that mean "this record is bad", not "the server is unavailable"
REJECTION_CODES = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS"}

log = logging.getLogger("hvd_runtime.tracking")


def rejected(exc: BaseException, group: list[dict]) -> bool:
    """True when the records, not the server, are at fault: sending them again cannot help.

    Anything unrecognised counts as a server failure, so its records are spooled, not lost. A model
    that cannot be exported (say torch.export on data-dependent control flow) is the model's fault.
    """
    code = getattr(exc, "error_code", None)
    if code is not None:
        return code in REJECTION_CODES
    return group[0]["kind"] == "model" and not isinstance(exc, (OSError, ConnectionError))


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(text) > 240:  # MLflow's messages put the URL first and the cause last: keep both
        text = f"{text[:120]} ... {text[-120:]}"
    return text


class Sender(threading.Thread):
    def __init__(self, uri: str, header: dict, params: dict, spool: Spool, warn: Callable[[str], None],
                 queue_size: int = 10_000, flavor: str | None = None):
        """flavor: the MLflow flavor of the run's models, for the tracking process to load early."""
        super().__init__(name="hvd-runtime-tracking", daemon=True)
        self.uri = uri
        self.flavor = flavor
        self.header = header
        self.params = params
        self.spool = spool
        self.warn = warn
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.run_id: str | None = header.get("run_id")
        self.ready = threading.Event()      # set once the run is open, or opening it failed
        self.failed = False
        self.abandoned = False
        self.inflight: list[dict] = []
        self.rejections = 0
        self.sink: RemoteSink | None = None
        self._sink_lock = threading.Lock()  # drain() never misses a tracking process being started
        self.models_done = 0                    # model records sent, spooled or dropped
        self._models_lock = threading.Lock()
        self.model_seconds: float | None = None  # how long the last one took to send
        self.model_finished = 0.0               # and when it was done (time.monotonic)

    def segment_head(self) -> list[dict]:
        """The spool's first lines: this run as known now, and its params."""
        return [{**self.header, "run_id": self.run_id}, self.params]

    def submit(self, record: dict) -> None:
        if self.abandoned:
            self.to_spool([record])
            self._count_models([record])
            return
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.warn(f"tracking fell {self.queue.maxsize} records behind the server")
            self.to_spool([record])
            self._count_models([record])

    def run(self) -> None:
        try:
            self.run_id = self._start_sink().open_run(self.header)
        except Exception as exc:
            self.fail(exc, [])      # the spool's head carries the run and its params
        else:
            self._send([self.params])
        finally:
            self.ready.set()
        done = False
        while not done:
            batch = self._take()
            done = batch[-1]["kind"] == "end"
            for group in records.group(batch):
                self._send(group)
        if self.sink is not None:
            self.sink.close()

    def _start_sink(self) -> RemoteSink:
        with self._sink_lock:
            if self.abandoned:
                raise ConnectionError("tracking was given up before MLflow started")
            self.sink = RemoteSink(self.uri, self.flavor)
            return self.sink

    def _send(self, group: list[dict]) -> None:
        if group[0]["kind"] != "model":
            self._apply(group)
            return
        started = time.monotonic()
        try:
            self._apply(group)
        finally:
            self.model_finished = time.monotonic()
            self.model_seconds = self.model_finished - started
            self._count_models(group)

    def _count_models(self, group: list[dict]) -> None:
        with self._models_lock:
            self.models_done += sum(record["kind"] == "model" for record in group)

    def _apply(self, group: list[dict]) -> None:
        if self.failed or self.abandoned:
            self.to_spool(group)
            return
        self.inflight = group
        try:
            self.sink.apply(self.run_id, group)
        except Exception as exc:
            if self.abandoned:          # drain spooled this group and ended the tracking process
                return
            if not rejected(exc, group):
                self.fail(exc, group)
            elif len(group) > 1:        # one bad key must not cost the other records of a batch
                for record in group:
                    self._apply([record])
            else:
                self._reject(exc, group[0])
        finally:
            self.inflight = []

    def _reject(self, exc: BaseException, record: dict) -> None:
        level = logging.INFO if self.rejections else logging.WARNING
        self.rejections += 1
        log.log(level, "MLflow rejected a %s record, which is dropped (%s)%s", record["kind"], _summary(exc),
                "" if self.rejections > 1 else "; further rejections are logged at INFO level")

    def _take(self) -> list[dict]:
        batch = [self.queue.get()]
        while len(batch) < MAX_BATCH and batch[-1]["kind"] != "end":
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def fail(self, exc: BaseException, pending: list[dict]) -> None:
        self.failed = True
        self.warn(f"MLflow at {self.header.get('tracking_uri', self.uri)} failed ({_summary(exc)})")
        self.to_spool(pending)

    def drain(self) -> None:
        """After close gave up waiting: spool what is queued and what is being sent, and end the
        tracking process (whatever it still waits on, the run's records are in the spool now)."""
        with self._sink_lock:
            self.abandoned = True
        self.to_spool(list(self.inflight))
        pending = []
        while True:
            try:
                pending.append(self.queue.get_nowait())
            except queue.Empty:
                break
        self.to_spool(pending)
        if self.sink is not None:   # last: this wakes the sender, which must find nothing left to send
            self.sink.kill()

    def to_spool(self, pending: list[dict]) -> None:
        """Write records to the spool; an in-memory model is saved there as an MLflow model first."""
        out = []
        for record in pending:
            if record["kind"] == "model" and "model" in record:
                record = self._save_model(record)
                if record is None:
                    continue
            out.append(record)
        try:
            self.spool.write(out)
        except Exception as exc:  # a full disk must not stop training either
            self.warn(f"could not write the tracking spool {self.spool.path} ({exc})")

    def _save_model(self, record: dict) -> dict | None:
        try:
            with MLFLOW_IMPORT:
                from .sink import save_model
            path = self.spool.new_slot(record["name"])
            save_model(record, path)
        except Exception as exc:
            self.warn(f"could not save the model to the tracking spool ({exc})")
            return None
        return {"kind": "model", "flavor": record["flavor"], "name": record["name"],
                "path": str(path.relative_to(self.spool.directory)),
                "step": record.get("step", 0)}
