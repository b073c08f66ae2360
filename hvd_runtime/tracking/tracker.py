"""What the training loop holds: `Tracker` on rank 0, `NullTracker` everywhere else.

Tracker methods return at once: records go to the background sender (sender.py). Two may
wait, each for a bounded time: `close` (for the sender to finish) and `run_id` (for the run to
open). `log_model` runs the model once on its example and copies it, nothing more.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from .. import watchdog
from . import records
from .sender import Sender

log = logging.getLogger("hvd_runtime.tracking")

CLOSE_TIMEOUT = 60.0    # seconds close() waits for the sender before spooling the rest
OPEN_TIMEOUT = 60.0     # seconds run_id waits for the run to open
CHECKPOINT_MODEL_SHARE = 0.1   # "auto": the most of a run's time that logging checkpoint models may take
FIRST_MODEL_SECONDS = 10.0     # "auto": the first model's cost, until one is measured (MLflow's flavor,
                               # and torch.export or Keras' tracing, import on first use)


def checkpoint_model_due(mode: str, in_flight: bool, since: float, last_cost: float | None) -> bool:
    """Whether an epoch's checkpoint becomes an MLflow model, `since` seconds after the run began
    or the last model was logged. "every": always; "final": never (the final model always is).
    "auto": when logging the last one (`last_cost` s; FIRST_MODEL_SECONDS before any) took at
    most CHECKPOINT_MODEL_SHARE of the time since, and it is not still being logged.

    Why: logging a model is seconds of Python (torch.export or Keras' tracing, a serving check,
    the store). A Keras model is logged in the training process, where it holds the interpreter's
    lock while training waits; a torch model in the tracking process (remote.py), which still
    takes a core that may be training's. A model every epoch costs a run of short epochs much of
    its speed (docs/benchmarks-tracking.md). A run whose epochs are long logs every epoch's
    checkpoint; one of short epochs some, or none but its final model.
    """
    if mode == "every":
        return True
    if mode == "final" or in_flight:
        return False
    cost = FIRST_MODEL_SECONDS if last_cost is None else last_cost
    return since >= cost * (1 / CHECKPOINT_MODEL_SHARE - 1)


class OneWarning:
    """Print the first problem as one warning that says what happens next; later ones quietly."""

    def __init__(self, spool_dir, uri: str):
        self.spool_dir, self.uri = spool_dir, uri
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, problem: str) -> None:
        with self._lock:
            self.count += 1
            first = self.count == 1
        if first:
            log.warning("%s; training continues, unsent tracking data goes to %s (send it later with: "
                        "python -m hvd_runtime.tracking.replay %s --uri %s)",
                        problem, self.spool_dir, self.spool_dir, self.uri)
        else:
            log.info("%s", problem)


class NullTracker:
    """Ranks other than 0, or tracking disabled: accepts every call, does nothing, imports nothing."""

    run_id = None

    def opened_run_id(self) -> str | None:
        return None

    def log_metrics(self, metrics, step):
        pass

    def set_tags(self, tags):
        pass

    def log_artifact(self, path, artifact_path=None):
        pass

    def log_model(self, model, input_example, name="model", step=0, checkpoint=False):
        pass

    def wants_checkpoint_model(self) -> bool:
        return False

    def close(self, status="FINISHED", timeout=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return False


class Tracker(NullTracker):
    def __init__(self, sender: Sender, warn: OneWarning, close_timeout: float = CLOSE_TIMEOUT,
                 checkpoint_models: str = "auto"):
        self._sender = sender
        self._warn = warn
        self._close_timeout = close_timeout
        self._closed = False
        self._no_snapshot = False    # warned that checkpoints cannot be logged as models
        self._checkpoint_models = checkpoint_models
        self._started = time.monotonic()
        self._models_submitted = 0
        atexit.register(self.close)     # a script that forgets close() still flushes and ends its run

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, to store with checkpoints; None if the run could not be opened.

        A server slow to open the run is not a hung step: the wait has the watchdog's allowance."""
        if not self._sender.ready.is_set():
            watchdog.beat("opening the MLflow run", allowance=True)
        self._sender.ready.wait(OPEN_TIMEOUT)
        return self._sender.run_id

    def opened_run_id(self) -> str | None:
        """The run id if the run is open already, else None: never waits."""
        return self._sender.run_id if self._sender.ready.is_set() else None

    @property
    def spool_path(self):
        return self._sender.spool.path

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Values already averaged across ranks (hvd.allreduce); one point per key and step."""
        if metrics:
            self._submit(lambda: records.metrics(metrics, step))

    def set_tags(self, tags: dict) -> None:
        self._submit(lambda: records.tags(tags))

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        """A file or a directory, read when it is sent (or copied when it is spooled)."""
        def record():
            if not os.path.exists(path):  # one missing file must not stop the rest of the run's tracking
                raise FileNotFoundError(f"no artifact at {path}")
            return records.artifact(os.path.abspath(path), artifact_path)
        self._submit(record)

    def log_model(self, model, input_example, name: str = "model", step: int = 0, checkpoint: bool = False) -> None:
        """torch.nn.Module -> mlflow.pytorch, keras.Model -> mlflow.tensorflow, with a signature
        inferred from `input_example` and the model's output on it: an MLflow 3 LoggedModel of
        the run at `step`. MLflow links to it the run's metrics logged at that step, so log the
        epoch's metrics first (log_metrics, a small record sent at once): a rank 0 lost while the
        model is still queued then loses the model, never the epoch's metrics.

        checkpoint: training goes on, so the model must be copied now; one that cannot be (see
        models.model_record) is skipped, with one warning. Which checkpoints are logged at all:
        config tracking.checkpoint_models (checkpoint_model_due).

        A ModelFile (a model's weights in one file, hvd_runtime.torch.whole_model or
        hvd_runtime.tf.whole_model) is logged as the model it builds; one not logged has its
        discardable file removed."""
        from .models import ModelFile, NoSnapshot, model_record

        if self._closed or (checkpoint and not self.wants_checkpoint_model()):
            if isinstance(model, ModelFile):
                model.finished()
            return

        def record():
            try:
                return model_record(model, input_example, name, step, checkpoint)
            except NoSnapshot as exc:
                if not self._no_snapshot:
                    log.warning("%s", exc)
                self._no_snapshot = True
                return None
        self._submit(record)

    def wants_checkpoint_model(self) -> bool:
        """Whether an epoch's checkpoint logged now becomes a model (config tracking.checkpoint_models,
        checkpoint_model_due). Ask before building a whole model only for it: a pipeline or
        tensor-parallel model is gathered to rank 0 from every rank."""
        if self._closed:
            return False
        sender = self._sender
        last = sender.model_finished if sender.model_seconds is not None else self._started
        return checkpoint_model_due(self._checkpoint_models, self._models_submitted > sender.models_done,
                                    time.monotonic() - last, sender.model_seconds)

    def _submit(self, make_record) -> None:
        if self._closed:
            return
        try:
            record = make_record()
        except Exception as exc:  # a bad value or model is reported, never raised into training
            log.warning("tracking call ignored: %s", exc)
            return
        if record is not None:  # None: nothing to send (a checkpoint that could not be copied)
            self._models_submitted += record["kind"] == "model"
            self._sender.submit(record)

    def close(self, status: str = "FINISHED", timeout: float | None = None) -> None:
        """End the run with `status`; wait at most `timeout` s (default CLOSE_TIMEOUT) for the
        sender, then spool what it has not sent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        timeout = self._close_timeout if timeout is None else timeout
        try:
            self._sender.submit(records.end(status))
            self._sender.join(timeout)
            if self._sender.is_alive() or not self._sender.queue.empty():
                self._warn(f"MLflow did not finish within {timeout:.0f} s")
                self._sender.drain()
        except Exception as exc:  # the end of training is no place to fail either
            log.warning("tracking could not close cleanly: %s", exc)

    def __exit__(self, exc_type, exc, tb):
        # a stop asked for by a signal (hvd_runtime.preemption.Preempted) is KILLED, any other exception FAILED
        self.close("FINISHED" if exc_type is None else getattr(exc, "run_status", "FAILED"))
        return False
