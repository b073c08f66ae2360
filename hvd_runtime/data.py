"""Datasets, and how they are cut into per-rank shards.

Each source gives a Dataset of splits (hvd_runtime.dataset, re-exported here): small data lives
in memory; an image folder (hvd_runtime.image_files) and a token file (hvd_runtime.tokens) are read
from disk batch by batch, so a dataset larger than memory trains. Framework-free: the torch and
TF runtimes both batch from these. Nothing here downloads: the default dataset (scikit-learn's
digits) ships inside a package, and the other sources read the user's own files or make synthetic
data for benchmarks.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from hvd_runtime.dataset import BatchSource, DataError, Dataset, Split, split_train_val
from hvd_runtime.image_files import load_image_folder
from hvd_runtime.tokens import load_tokens

__all__ = ["BatchSource", "DataError", "Dataset", "EpochShards", "Split", "digits_file", "load_dataset", "load_digits",
           "load_image_folder", "load_npz", "load_tokens", "make_synthetic", "shard_indices", "split_train_val"]


def _finish(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int, classes=()) -> Dataset:
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.ascontiguousarray(y, dtype=np.int64)
    train, val = split_train_val(x, y, val_fraction, seed)
    return Dataset(train, val, num_classes=int(y.max()) + 1, classes=tuple(classes))


def digits_file() -> Path:
    """The digits CSV inside the installed scikit-learn, found without importing scikit-learn.

    Importing it (scipy with it) cost every rank about 2 s of CPU before its first step, several
    times that with all ranks of a job starting together on a few cores; the data is one 57 kB file.
    """
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        raise DataError("data.source digits needs scikit-learn, whose package ships the digits: "
                        "pip install scikit-learn, or set data.source to npz or image_folder")
    return path


def load_digits(val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), scaled to [0, 1].

    Each row of the file is 64 pixel values (0-16) and the label, as sklearn.datasets.load_digits
    reads it (tests/runtime/test_data.py holds the two equal)."""
    table = np.loadtxt(digits_file(), delimiter=",")
    return _finish(table[:, :-1] / 16.0, table[:, -1].astype(np.int64), val_fraction, seed,
                   [str(c) for c in range(10)])


def load_npz(path: str | Path, val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Arrays from an .npz: either x and y (split here) or x_train, y_train, x_val, y_val."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.path {str(path)!r} is not a file: point it at an .npz with x and y arrays")
    try:
        file = np.load(path)
        if not isinstance(file, np.lib.npyio.NpzFile):
            raise ValueError("it holds one array, as numpy.save writes: an .npz names its arrays")
        with file:
            arrays = {key: file[key] for key in file.files}
    except (OSError, ValueError) as exc:  # not an .npz, truncated, or arrays of pickled objects
        raise DataError(f"data.path {str(path)!r} is not a readable .npz ({exc}): "
                        f"write it with numpy.savez(path, x=..., y=...)") from exc
    for x, y in (("x", "y"), ("x_train", "y_train"), ("x_val", "y_val")):
        if x in arrays and y in arrays and len(arrays[x]) != len(arrays[y]):
            raise DataError(f"data.path {str(path)!r} holds {len(arrays[x])} rows of {x} but {len(arrays[y])} of "
                            f"{y}: each sample needs its label, one row of {y} for each row of {x}")
    if {"x_train", "y_train", "x_val", "y_val"} <= arrays.keys():
        train = Split(arrays["x_train"].astype(np.float32), arrays["y_train"].astype(np.int64))
        val = Split(arrays["x_val"].astype(np.float32), arrays["y_val"].astype(np.int64))
        return Dataset(train, val, int(max(train.y.max(), val.y.max())) + 1)
    if {"x", "y"} <= arrays.keys():
        return _finish(arrays["x"], arrays["y"], val_fraction, seed)
    raise DataError(f"data.path {str(path)!r} must hold arrays x and y, or x_train, y_train, x_val and y_val; "
                    f"it has {sorted(arrays)}")


def make_synthetic(samples: int, features: int, classes: int, val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Linearly separable-ish Gaussian blobs: learnable, so benchmarks train on something real."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 1.0, size=(classes, features))
    y = rng.integers(0, classes, size=samples)
    x = centers[y] + rng.normal(0.0, 1.0, size=(samples, features))
    return _finish(x, y, val_fraction, seed)


def load_dataset(cfg, seed: int = 0, context: int | None = None) -> Dataset:
    """Dispatch on `cfg.source` (a DataConfig); `context` is a language model's window, for tokens."""
    if cfg.source == "tokens" and context is None:
        raise DataError("data.source tokens feeds a language model: generate one with hvdgen new --model gpt, "
                        "or choose another data.source")
    loaders = {
        "digits": lambda: load_digits(cfg.val_fraction, seed),
        "npz": lambda: load_npz(cfg.path, cfg.val_fraction, seed),
        "image_folder": lambda: load_image_folder(cfg.path, cfg.image_size, cfg.val_fraction, seed),
        "synthetic": lambda: make_synthetic(cfg.synthetic_samples, cfg.synthetic_features, cfg.synthetic_classes,
                                            cfg.val_fraction, seed),
        "tokens": lambda: load_tokens(cfg.path, context, seed),
    }
    if cfg.source not in loaders:
        raise DataError(f"unknown data.source {cfg.source!r}: choose one of {', '.join(loaders)}")
    return loaders[cfg.source]()


def shard_indices(n: int, rank: int, size: int, epoch: int, seed: int, shuffle: bool, pad: bool,
                  consumed: int = 0) -> np.ndarray:
    """This rank's sample indices for one epoch, after the first `consumed` of the epoch's order.

    Every rank draws the same permutation (seed + epoch) and takes every size-th index of what
    is left, so shards are disjoint. Because a step consumes a contiguous stretch of that order
    across ranks, resuming after `consumed` samples, even with another number of ranks (an
    elastic reset), continues exactly where the epoch stopped: no sample skipped or repeated.
    With `pad`, the rest is filled up from the start of the epoch's order until it divides
    evenly, so every rank takes the same number of steps, which the gradient allreduce needs.
    Without it (for evaluation), shards are uneven and every sample is seen exactly once.
    """
    order = np.random.default_rng(seed + epoch).permutation(n) if shuffle else np.arange(n)
    rest = order[consumed:]
    if pad and len(rest):
        # Filled from the start of the epoch's order, not of the rest: a job resumed at the same
        # size then pads with the very samples an uninterrupted run pads with.
        rest = np.concatenate([rest, np.resize(order, -len(rest) % size)])
    return rest[rank::size]


class EpochShards:
    """This rank's share of every epoch, in batches: the arithmetic both frameworks' batchers share.

    Progress through an epoch is counted in samples consumed across all ranks, which is what a
    resumed or resized (elastic) job needs to carry on exactly where the epoch stopped.
    """

    def __init__(self, samples: int, batch_size: int, rank: int, size: int, *, seed: int = 0, train: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.samples, self.batch_size, self.seed, self.train = samples, batch_size, seed, train
        self.rank, self.size = rank, size

    def reshard(self, rank: int, size: int) -> None:
        """After an elastic reset: this process's new rank in a job of a new size."""
        self.rank, self.size = rank, size

    @property
    def samples_per_step(self) -> int:
        """Samples of the epoch's order one step consumes, over all ranks."""
        return self.batch_size * self.size

    def steps(self, consumed: int = 0) -> int:
        """Steps left in an epoch of which `consumed` samples are done (the same on every rank)."""
        return math.ceil(math.ceil(max(0, self.samples - consumed) / self.size) / self.batch_size)

    def indices(self, epoch: int, consumed: int = 0) -> np.ndarray:
        return shard_indices(self.samples, self.rank, self.size, epoch, self.seed,
                             shuffle=self.train, pad=self.train, consumed=consumed)

    def __len__(self) -> int:
        if self.train:
            return self.steps()
        return math.ceil(len(self.indices(0)) / self.batch_size)
