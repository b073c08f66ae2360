"""The only module that talks to MLflow: open or reopen a run, and apply record groups to it.

Used by the background sender during training and by replay afterwards, so a spooled record
reaches a server through exactly the code a live one does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from packaging.version import InvalidVersion, Version

from .models import finished, live

ORIGINAL_RUN_TAG = "hvd_runtime.original_run_id"      # set when a stored run id is not on this server
CHANGED_PARAMS_TAG = "hvd_runtime.params_changed"     # MLflow params are write-once; a resume may differ
MODEL_ARGUMENT = {"pytorch": "pytorch_model", "tensorflow": "model"}
PARAMS_PER_REQUEST = 100
METRICS_PER_REQUEST = 1000


class _DroppedNote(logging.Filter):
    """Drops a library's log records that contain `text` (from one thread only, if given)."""

    def __init__(self, text: str, thread: int | None = None):
        super().__init__()
        self.text, self.thread = text, thread

    def filter(self, record: logging.LogRecord) -> bool:
        return (self.thread is not None and record.thread != self.thread) or self.text not in record.getMessage()


@contextlib.contextmanager
def _dropped(logger: str, text: str, thread: int | None = None):
    """While inside: `logger`'s records containing `text` (from `thread`, if given) are not shown."""
    log, note = logging.getLogger(logger), _DroppedNote(text, thread)
    log.addFilter(note)
    try:
        yield
    finally:
        log.removeFilter(note)


@contextlib.contextmanager
def _quiet_keras():
    """Keras' progress bars off while a model is logged: MLflow checks a model by predicting its
    input example, and Keras would draw a "1/1 ━━━━" bar into the job's output at every epoch;
    and TensorFlow's "N of the last N calls ... triggered tf.function retracing" warning dropped on
    this thread: each epoch's checkpoint is a fresh clone whose predict function traces once
    (about 0.1 s), which from the fifth TensorFlow would call a loop's mistake, twice a line, in
    every tracked run. The same warning from training itself still shows."""
    import keras

    was_on = keras.config.is_interactive_logging_enabled()
    keras.config.disable_interactive_logging()
    try:
        with _dropped("tensorflow", "triggered tf.function retracing", threading.get_ident()):
            yield
    finally:
        if was_on:
            keras.config.enable_interactive_logging()


def _flavor(name: str):
    return importlib.import_module(f"mlflow.{name}")


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _public_pin(requirement: str) -> str:
    """`torch==2.13.0+cpu` -> `torch==2.13.0`: the pin that installs from PyPI, where a build's
    local label (+cpu, +cu130) names no file. MLflow means to strip it, but its way of doing so
    (a Version subclass hiding `.local`) no longer works with packaging 26's `str()`."""
    name, equals, version = requirement.partition("==")
    try:
        return f"{name}=={Version(version).public}" if equals else requirement
    except InvalidVersion:
        return requirement


@functools.cache  # once per flavor: each model of a run (one per checkpoint) has the same
def _requirements(flavor) -> list[str]:
    """The flavor's pinned defaults (torch or tensorflow, cloudpickle...), given explicitly because
    MLflow's inference re-imports the model in a subprocess: ~10 s per model on a small CPU node,
    and a generated project's own package is not on PyPI for it to find anyway. MLflow's warning
    that it pins a framework without its local version label is dropped: _public_pin does drop
    it, so a CPU torch's every tracked run would warn about nothing."""
    with _dropped("mlflow.utils.requirements_utils", "local version label"):
        return [_public_pin(requirement) for requirement in flavor.get_default_pip_requirements()]


def prepare_flavor(name: str) -> None:
    """Import a flavor and what its first model's logging needs (pytorch: torch and torch.export,
    as MLflow 3 saves pt2), and pin its requirements: seconds, once a process."""
    flavor = _flavor(name)
    if name == "pytorch":
        importlib.import_module("torch.export")
    _requirements(flavor)


def _signature(record: dict):
    """The model's signature, from its example input and the output the training thread saw."""
    from mlflow.models import infer_signature

    return infer_signature(record["input_example"], record["output_example"])


def save_model(record: dict, path: Path) -> None:
    """Write an in-memory model record as an MLflow model directory (signature and example kept)."""
    flavor, saved = _flavor(record["flavor"]), live(record)
    flavor.save_model(saved["model"], str(path), signature=_signature(saved),
                      input_example=saved["input_example"], pip_requirements=_requirements(flavor))
    finished(record)


class MlflowSink:
    def __init__(self, uri: str):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)

    def open_run(self, header: dict, reopen: bool = True) -> str:
        """Continue the header's run when this server has it, else create one in its experiment."""
        experiment_id = self._experiment_id(header["experiment"])
        wanted = header.get("run_id")
        if wanted and self._run_exists(wanted):
            if reopen:
                self.client.update_run(wanted, status="RUNNING")
            return wanted
        tags = dict(header.get("tags") or {})
        if wanted:
            tags[ORIGINAL_RUN_TAG] = wanted
        run = self.client.create_run(experiment_id, start_time=header.get("start_time"), tags=tags,
                                     run_name=header.get("run_name"))
        return run.info.run_id

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException as exc:  # another job created it between our two calls
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def _run_exists(self, run_id: str) -> bool:
        """False for a deleted run too: it takes no more data, so the job starts a new one."""
        try:
            return self.client.get_run(run_id).info.lifecycle_stage != "deleted"
        except MlflowException as exc:  # anything but "no such run" (e.g. no server) must propagate
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return False
            raise

    def apply(self, run_id: str, group: list[dict], base: Path | None = None) -> None:
        """Send one group from records.group; paths in it are relative to `base` (the spool)."""
        kind = group[0]["kind"]
        if kind == "metrics":
            metrics = [Metric(key, value, r["timestamp"], r["step"])
                       for r in group for key, value in r["metrics"].items()]
            for chunk in _chunks(metrics, METRICS_PER_REQUEST):
                self.client.log_batch(run_id, metrics=chunk)
        elif kind == "params":
            self._params(run_id, {k: v for r in group for k, v in r["params"].items()})
        elif kind == "tags":
            tags = [RunTag(k, v) for r in group for k, v in r["tags"].items()]
            self.client.log_batch(run_id, tags=tags)
        elif kind == "artifact":
            for record in group:
                self._artifact(run_id, record, base)
        elif kind == "model":
            for record in group:
                self._model(run_id, record, base)
        elif kind == "end":
            self.client.set_terminated(run_id, status=group[-1]["status"], end_time=group[-1]["end_time"])

    def _params(self, run_id: str, params: dict[str, str]) -> None:
        existing = self.client.get_run(run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        for chunk in _chunks(new, PARAMS_PER_REQUEST):
            self.client.log_batch(run_id, params=chunk)
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            self.client.set_tag(run_id, CHANGED_PARAMS_TAG, ",".join(changed)[:5000])

    def _artifact(self, run_id: str, record: dict, base: Path | None) -> None:
        if record.get("missing"):
            return
        path = Path(base or ".") / record["path"]
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), record.get("artifact_path") or path.name)
        else:
            self.client.log_artifact(run_id, str(path), record.get("artifact_path"))

    def _model(self, run_id: str, record: dict, base: Path | None) -> None:
        flavor = _flavor(record["flavor"])
        if "path" in record:  # a spooled model: load it back, so it is logged like a live one
            local = str(Path(base or ".") / record["path"])
            saved = Model.load(local)
            model, signature, example = flavor.load_model(local), saved.signature, saved.load_input_example(local)
        else:
            built = live(record)
            model, signature, example = built["model"], _signature(built), built["input_example"]
        # Model.log finds the store and the experiment through MLflow's process-wide state, not
        # the run: point both at this run (this process logs to one place anyway).
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment(experiment_id=self.client.get_run(run_id).info.experiment_id)
        # At its step: MLflow links the run's metrics of that step (the epoch's, sent before) to it.
        with _quiet_keras() if record["flavor"] == "tensorflow" else contextlib.nullcontext():
            Model.log(artifact_path=None, name=record["name"], flavor=flavor, run_id=run_id, signature=signature,
                      input_example=example, pip_requirements=_requirements(flavor), step=int(record.get("step", 0)),
                      **{MODEL_ARGUMENT[record["flavor"]]: model})
        finished(record)
