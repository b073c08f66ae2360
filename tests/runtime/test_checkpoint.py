import pickle

import pytest

from hvd_runtime.checkpoint import CheckpointStore


def write(obj):
    return lambda path: path.write_bytes(pickle.dumps(obj))


def read(path):
    return pickle.loads(path.read_bytes())


def test_keeps_the_last_k_and_loads_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2, suffix="pkl")
    for step in (10, 20, 30):
        store.save(step, write({"step": step}))
    assert [p.name for p in store.paths()] == ["ckpt-000000030.pkl", "ckpt-000000020.pkl"]
    path, payload = store.load_latest(read)
    assert payload == {"step": 30}
    assert not list(tmp_path.glob("*.tmp"))


def test_non_writer_never_touches_disk(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", is_writer=False)
    assert store.save(1, write({})) is None
    assert not (tmp_path / "ckpt").exists()


def test_truncated_latest_falls_back_with_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep=3, suffix="pkl")
    store.save(1, write({"step": 1}))
    newest = store.save(2, write({"step": 2, "blob": b"x" * 1000}))
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.warns(UserWarning, match="could not be read"):
        path, payload = store.load_latest(read)
    assert payload == {"step": 1}


def test_failed_write_leaves_no_file(tmp_path):
    store = CheckpointStore(tmp_path, suffix="pkl")

    def explode(path):
        path.write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.save(5, explode)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_of_another_model_is_named_not_loaded():
    """Another dataset's classes change the head: the user gets the layer, both shapes and the fix."""
    torch = pytest.importorskip("torch")
    from hvd_runtime.torch.legacy_checkpoint import model_misfit

    ten, three = torch.nn.Linear(4, 10), torch.nn.Linear(4, 3)
    assert model_misfit(ten.state_dict(), torch.nn.Linear(4, 10).state_dict()) is None
    message = model_misfit(ten.state_dict(), three.state_dict())
    assert message.startswith("the newest checkpoint holds a different model (bias: (10,) saved, (3,) now)")
    assert "--checkpoint.dir" in message and "--checkpoint.resume false" in message


def test_a_keras_checkpoint_of_another_model_is_named_not_loaded():
    pytest.importorskip("tensorflow")
    import keras
    import numpy as np

    from hvd_runtime.tf.legacy_checkpoint import misfit

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    fits = [np.zeros(v.shape) for v in model.variables]
    assert misfit(model.variables, fits, "model") is None
    other = [np.zeros((4, 10)), np.zeros((10,))]
    assert "(4, 10) saved, (4, 3) now" in misfit(model.variables, other, "model")
    assert "1 model arrays saved, 2 variables now" in misfit(model.variables, other[:1], "model")
