import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvd_runtime.config import DataConfig
from hvd_runtime.data import DataError, EpochShards, load_dataset, load_image_folder, load_npz, shard_indices


@pytest.mark.parametrize("n, size", [(10, 3), (1797, 2), (7, 4), (8, 8), (5, 8)])
def test_training_shards_are_even_and_cover_everything(n, size):
    shards = [shard_indices(n, r, size, epoch=1, seed=3, shuffle=True, pad=True) for r in range(size)]
    assert len({len(s) for s in shards}) == 1                 # same number of steps on every rank
    assert set(np.concatenate(shards)) == set(range(n))       # nothing skipped
    assert sum(len(s) for s in shards) - n < size             # at most size-1 repeats


@pytest.mark.parametrize("n, size", [(10, 3), (7, 4), (3, 4)])
def test_eval_shards_see_each_sample_once(n, size):
    shards = [shard_indices(n, r, size, epoch=0, seed=0, shuffle=False, pad=False) for r in range(size)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(n))


def test_shuffle_changes_with_epoch_but_not_with_rank_view():
    a = shard_indices(100, 0, 2, epoch=0, seed=1, shuffle=True, pad=True)
    b = shard_indices(100, 0, 2, epoch=1, seed=1, shuffle=True, pad=True)
    assert not np.array_equal(a, b)
    other = shard_indices(100, 1, 2, epoch=0, seed=1, shuffle=True, pad=True)
    assert not set(a) & set(other)


@pytest.mark.parametrize("size_before, size_after", [(2, 2), (2, 1), (1, 3), (4, 2)])
def test_resuming_after_consumed_samples_continues_the_epoch(size_before, size_after):
    """A job stopped after k steps (or resized by an elastic reset) sees exactly the rest."""
    n, batch, steps_done = 101, 4, 5
    consumed = steps_done * batch * size_before
    before = [shard_indices(n, r, size_before, 2, 9, shuffle=True, pad=True)[:steps_done * batch]
              for r in range(size_before)]
    after = [shard_indices(n, r, size_after, 2, 9, shuffle=True, pad=True, consumed=consumed)
             for r in range(size_after)]
    done, rest = set(np.concatenate(before)), np.concatenate(after)
    assert len(done) == consumed
    # the rest of the epoch, each sample once, plus at most size-1 repeats to even out the shards
    assert set(rest) - done == set(range(n)) - done and len(set(rest) - done) == n - consumed
    assert len(rest) - (n - consumed) < size_after
    if size_after == size_before:   # a plain restart: the very batches, padding included, of a run never stopped
        for r in range(size_after):
            whole = shard_indices(n, r, size_before, 2, 9, shuffle=True, pad=True)
            assert np.array_equal(after[r], whole[steps_done * batch:])


def test_epoch_shards_count_steps_of_the_padded_shard():
    shards = EpochShards(1437, 32, rank=1, size=2)
    assert shards.steps() == len(shards) == 23 == -(-len(shards.indices(0)) // 32)
    assert shards.steps(consumed=64 * 20) == 3       # 157 samples left: 79 per rank
    shards.reshard(0, 1)
    assert shards.steps(consumed=64 * 20) == 5 and shards.samples_per_step == 32


def test_digits_loads_offline_and_is_scaled():
    ds = load_dataset(DataConfig(), seed=0)
    assert ds.num_classes == 10 and ds.input_shape == (64,)
    assert len(ds.train) + len(ds.val) == 1797
    assert 0.0 <= ds.train.x.min() and ds.train.x.max() <= 1.0
    assert ds.train.x.dtype == np.float32 and ds.train.y.dtype == np.int64


def test_digits_equal_scikit_learns_own_loader_without_importing_it():
    """Read straight from the file scikit-learn ships, they are its digits; and no rank imports it."""
    from sklearn.datasets import load_digits as sk_digits
    from hvd_runtime.data import load_digits, split_train_val

    bunch = sk_digits()
    ours = load_digits(0.25, seed=7)
    train, val = split_train_val(bunch.data / 16.0, bunch.target, 0.25, seed=7)
    for mine, theirs in ((ours.train, train), (ours.val, val)):
        np.testing.assert_array_equal(mine.x, theirs.x.astype(np.float32))
        np.testing.assert_array_equal(mine.y, theirs.y)
    code = ("import sys; from hvd_runtime.data import load_digits; load_digits(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy'}))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert imported == "[]"


def test_npz_with_and_without_split(tmp_path):
    x, y = np.random.rand(50, 3).astype(np.float32), np.arange(50) % 5
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    ds = load_npz(tmp_path / "xy.npz", val_fraction=0.2)
    assert (len(ds.train), len(ds.val), ds.num_classes) == (40, 10, 5)
    np.savez(tmp_path / "split.npz", x_train=x[:30], y_train=y[:30], x_val=x[30:], y_val=y[30:])
    ds = load_npz(tmp_path / "split.npz")
    assert (len(ds.train), len(ds.val)) == (30, 20)


@pytest.mark.parametrize("write, problem", [
    (lambda path: np.savez(path, features=np.zeros(3)), "must hold arrays x and y, or x_train, y_train, x_val and "
                                                        "y_val; it has ['features']"),
    (None, "is not a file: point it at an .npz with x and y arrays"),
    (lambda path: path.write_text("x,y\n1,2\n"), "is not a readable .npz ("),
    (lambda path: np.save(path.with_suffix(".npy"), np.zeros(3)) or path.with_suffix(".npy").rename(path),
     "is not a readable .npz (it holds one array, as numpy.save writes"),
    (lambda path: np.savez(path, x=np.array([object()]), y=np.zeros(1)), "is not a readable .npz (Object arrays"),
    (lambda path: np.savez(path, x=np.zeros((10, 4)), y=np.zeros(7)),
     "holds 10 rows of x but 7 of y: each sample needs its label, one row of y for each row of x"),
    (lambda path: np.savez(path, x_train=np.zeros((6, 4)), y_train=np.zeros(6), x_val=np.zeros((3, 4)),
                           y_val=np.zeros(2)), "holds 3 rows of x_val but 2 of y_val"),
])
def test_unreadable_npz_is_a_data_error_of_one_line_naming_the_fix(tmp_path, write, problem):
    """What a user gets wrong with their own arrays: a config error (train.py prints it as one
    line per rank), naming data.path and how to write the file."""
    path = tmp_path / "mine.npz"
    if write:
        write(path)
    with pytest.raises(DataError) as error:
        load_npz(path)
    message = str(error.value)
    assert message.startswith(f"data.path {str(path)!r} ") and problem in message and "\n" not in message
    if problem.startswith("is not a readable"):
        assert message.endswith("write it with numpy.savez(path, x=..., y=...)")


def test_image_folder(tmp_path):
    from PIL import Image

    for cls, colour in (("cats", (255, 0, 0)), ("dogs", (0, 0, 255))):
        (tmp_path / cls).mkdir()
        for i in range(5):
            Image.new("RGB", (20, 12), colour).save(tmp_path / cls / f"{i}.png")
    ds = load_image_folder(tmp_path, image_size=8, val_fraction=0.2)
    assert ds.classes == ("cats", "dogs") and ds.input_shape == (3, 8, 8)
    assert len(ds.train) + len(ds.val) == 10

    (tmp_path / "dogs" / "notes.png").write_text("not a picture")
    with pytest.raises(DataError, match=r"dogs/notes.png is not a readable image \(cannot identify image file .*\): "
                                        r"replace or remove it from data.path$"):
        load_image_folder(tmp_path, image_size=8)
    with pytest.raises(DataError, match=r"has no class sub-folders: use ROOT/<class>/<image files>, or ROOT/train/"):
        load_image_folder(tmp_path / "cats", image_size=8)


def test_unknown_source_names_the_choices():
    with pytest.raises(DataError, match="unknown data.source 'csv'"):
        load_dataset(DataConfig(source="csv"))
