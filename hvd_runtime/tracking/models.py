"""Turn a live model into a model record: which MLflow flavor, the model as bytes, and one forward pass.

Runs in the training thread, because the signature needs the model's output on the example as the
model is now, and because the bytes are the snapshot: training may go on changing the model while
the record waits for the tracking process, and a checkpoint's LoggedModel must hold that epoch's
weights. MLflow is never imported here (the tracking process infers the signature from the two
arrays); the frameworks are found in sys.modules, never imported: a torch job has no TF, and the
other way round.
"""

from __future__ import annotations

import copy
import logging
import pickle
import sys

import cloudpickle
import numpy as np

log = logging.getLogger("hvd_runtime.tracking")


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


def _keras_forward(model, example):
    inputs = np.asarray(example)
    return inputs, np.asarray(model(inputs, training=False))


def _keras_bytes(model) -> bytes:
    """The model as its .keras file (Keras pickles that way), loaded back once here: a class Keras
    cannot find by name (a subclass with no get_config, one not registered) fails now, in the
    training process, rather than in the tracking process after the run has moved on."""
    payload = cloudpickle.dumps(model)
    pickle.loads(payload)
    return payload


def _torch_bytes(model) -> bytes:
    """A CPU copy: the tracking process sees no GPU (it must not take one's memory), and a model
    logged from CPU weights loads anywhere."""
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type != "cpu":
        model = copy.deepcopy(model).cpu()
    return cloudpickle.dumps(model)


class NoSnapshot(Exception):
    """The model cannot be turned into bytes, so it cannot reach the tracking process."""


def model_record(model, input_example, name: str = "model", step: int = 0, checkpoint: bool = False) -> dict:
    """A record for the tracking process: the model pickled now (cloudpickle, so that a class
    defined in the training script travels too; a Keras model pickles as its .keras file), the
    example as an array and the model's output on it, from which MLflow infers the signature.

    A model that cannot be pickled raises NoSnapshot: a checkpoint is then not logged as a model
    (its metrics are), and the final model is not logged, each with one warning.
    """
    flavor = flavor_of(model)
    inputs, outputs = (_torch_forward if flavor == "pytorch" else _keras_forward)(model, input_example)
    try:
        payload = _torch_bytes(model) if flavor == "pytorch" else _keras_bytes(model)
    except Exception as exc:  # noqa: BLE001 - any failure to pickle only costs the model record
        what = "its checkpoints are not logged as models (their metrics are)" if checkpoint else \
            "the final model is not logged"
        raise NoSnapshot(f"a {type(model).__name__} cannot be pickled for the tracking process ({exc}), "
                         f"so {what}") from exc
    return {"kind": "model", "flavor": flavor, "name": name, "payload": payload, "inputs": inputs,
            "outputs": outputs, "step": int(step)}
