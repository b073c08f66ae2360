"""The types every data source shares: the splits the batchers read, the dataset, its error.

A split is anything with a length and `take(indices, epoch)` returning a batch as NumPy arrays:
small data lives in memory (`Split`); an image folder (hvd_runtime.image_files) and a token file
(hvd_runtime.tokens) are read from disk batch by batch. hvd_runtime.data loads each source and
cuts the splits into per-rank shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvd_runtime.config import ConfigError

__all__ = ["BatchSource", "DataError", "Dataset", "Split", "split_train_val"]


class DataError(ConfigError):
    """The configured data cannot be read: a missing or malformed file, a folder without classes.

    A ConfigError, because the fix is in the config (data.source, data.path) or in the user's
    files: train.py prints it as one `config error:` line, from rank 0, not a traceback from each rank.
    """


class BatchSource:
    """What every split offers beside `len` and `take`: splits in memory say streamed = False."""

    streamed = True
    input_dtype = np.float32    # what take() gives as x: a graph (tf.data) must know it before reading
    target_shape: tuple[int, ...] = ()   # one class per sample; a language model's split has one per token

    def first(self, n: int) -> np.ndarray:
        """The inputs of the first n samples: an example batch (tracing, model signatures)."""
        return self.examples(n)[0]

    def examples(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first n samples, inputs and targets: what a time-balanced pipeline split is timed on."""
        return self.take(np.arange(min(n, len(self))))


@dataclass(frozen=True)
class Split(BatchSource):
    """Samples held in memory: the batchers slice them directly, with no worker processes."""

    x: np.ndarray  # float32, (N, ...)
    y: np.ndarray  # int64, (N,)
    streamed = False

    def __len__(self) -> int:
        return len(self.y)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def take(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        return self.x[indices], self.y[indices]


@dataclass(frozen=True)
class Dataset:
    train: Split
    val: Split
    num_classes: int            # classes, or a language model's vocabulary size
    classes: tuple[str, ...] = ()

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train.sample_shape


def split_train_val(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int) -> tuple[Split, Split]:
    """A seeded, stratification-free shuffle split; identical on every rank for the same seed."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = max(1, int(round(len(y) * val_fraction)))
    val, train = order[:n_val], order[n_val:]
    return Split(x[train], y[train]), Split(x[val], y[val])
