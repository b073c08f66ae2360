"""Turn a live model into a model record: which MLflow flavor, a snapshot, and an example's output.

Runs in the training thread, because the signature needs one forward pass on the model as it is
now; MLflow turns the example and that output into the signature where the model is logged (the
tracking process, see remote.py), so the training process need not import MLflow. The
frameworks are found in sys.modules, never imported: a torch job has no TF, and the other way
round.

A model kept as a file (ModelFile: its weights, written by rank 0 from a checkpoint's shards) is
the exception: it is built whole, and its example run, only where it is logged.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

log = logging.getLogger("hvd_runtime.tracking")


@dataclass(frozen=True)
class ModelFile:
    """A model kept as a safetensors file of its whole weights (hvd_runtime.torch.whole_model,
    hvd_runtime.tf.whole_model), and `load`, which builds the whole model with those weights:
    what a run logs in place of a live model, so that no training process holds the whole model
    while it trains to log it. Whoever logs it loads it (`live`: a torch model in the tracking
    process, a Keras one where it is logged, or the spool when the server is down). `discard`: the
    file is a copy made for this record alone, removed once it is logged (`finished`). `flavor`:
    MLflow's, "pytorch" or "tensorflow"."""

    weights: str
    load: Callable
    discard: bool = False
    flavor: str = "pytorch"

    def finished(self) -> None:
        if self.discard:
            try:
                os.remove(self.weights)
            except FileNotFoundError:
                pass


def live(record: dict) -> dict:
    """The record with a ModelFile built, its weights loaded and its example's output computed
    (the signature needs it), ready to log; any other record as it is."""
    model = record["model"]
    if not isinstance(model, ModelFile):
        return record
    whole = model.load()
    forward = _torch_forward if model.flavor == "pytorch" else _keras_forward
    inputs, outputs = forward(whole, record["input_example"])
    return {**record, "model": whole, "input_example": inputs, "output_example": outputs}


def finished(record: dict) -> None:
    """Once the record's model is logged or saved: a ModelFile's copy of the weights is removed."""
    if isinstance(record.get("model"), ModelFile):
        record["model"].finished()


def flavor_of(model) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "pytorch"
    for name in ("keras", "tensorflow"):
        module = sys.modules.get(name)
        keras_model = getattr(module, "Model", None) or getattr(getattr(module, "keras", None), "Model", None)
        if keras_model is not None and isinstance(model, keras_model):
            return "tensorflow"
    raise TypeError(f"cannot log a {type(model).__name__}: expected a torch.nn.Module or a keras.Model")


def _torch_forward(model, example):
    torch = sys.modules["torch"]
    first = next(iter(model.parameters()), None)
    inputs = torch.as_tensor(example)
    if first is not None:  # numpy examples are often float64; the model decides
        inputs = inputs.to(first.device, first.dtype if inputs.is_floating_point() else None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(inputs)
    finally:
        model.train(was_training)
    return inputs.cpu().numpy(), output.detach().cpu().numpy()


class NoSnapshot(Exception):
    """The model cannot be copied as it is now."""


def _keras_snapshot(model):
    """A clone holding the model's weights now; None where Keras cannot clone it."""
    keras = sys.modules.get("keras") or sys.modules["tensorflow"].keras
    try:
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
    except Exception as exc:  # noqa: BLE001 - any failure to clone only costs the snapshot
        log.debug("cannot clone the Keras model: %s", exc)
        return None
    return clone


def _keras_forward(model, example):
    inputs = np.asarray(example)
    return inputs, np.asarray(model(inputs, training=False))


def model_record(model, input_example, name: str = "model", step: int = 0, checkpoint: bool = False) -> dict:
    """An in-memory record (holds objects, not JSON) for the sender to log or to spool.

    The model is copied with this moment's weights (torch: a deep copy; Keras: a clone holding
    the same weights), so that training may go on changing it while the record waits in the
    queue: a checkpoint's LoggedModel is that epoch's model. A Keras model that cannot be cloned
    (a layer without get_config, or one tied to another, as the GPT's head to its embedding) is
    logged as it is when sent if it is the final model (training is over); a checkpoint raises
    NoSnapshot rather than log later weights under its name. A ModelFile is its own snapshot.
    """
    if isinstance(model, ModelFile):  # built and run where it is logged (live)
        return {"kind": "model", "flavor": model.flavor, "name": name, "model": model,
                "input_example": np.asarray(input_example), "output_example": None, "step": int(step)}
    flavor = flavor_of(model)
    inputs, outputs = (_torch_forward if flavor == "pytorch" else _keras_forward)(model, input_example)
    snapshot = copy.deepcopy(model) if flavor == "pytorch" else _keras_snapshot(model)
    if snapshot is None:
        if checkpoint:
            raise NoSnapshot(f"a {type(model).__name__} cannot be cloned, so its checkpoints are not logged as "
                             "models (their metrics are); the final model is")
        snapshot = model
    return {"kind": "model", "flavor": flavor, "name": name, "model": snapshot,
            "input_example": inputs, "output_example": outputs, "step": int(step)}
