"""A language model's data: a flat file of token ids, read through np.memmap in context windows.

The format nanoGPT uses: PATH/train.bin and PATH/val.bin hold the tokens back to back, and
PATH/meta.json names the vocabulary size and the ids' type ({"vocab_size": 256} for bytes;
"dtype": "uint32" for a vocabulary past 65536 ids, uint16 otherwise, as the project's
prepare_tokens.py writes). Nothing is loaded: a batch reads only its windows' pages, so a token
file of any size trains. Sample i of an epoch is the window starting at offset + i * context,
its target the same window one token later; the offset is drawn per epoch for training (seeded,
so a resumed job draws the same), which moves the window boundaries from epoch to epoch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hvd_runtime.dataset import BatchSource, Dataset, DataError

DTYPES = ("uint16", "uint32")   # meta.json's "dtype"; uint16 when it names none
FILES = ("train.bin", "val.bin")
MAKE_THEM = "make them with: python prepare_tokens.py my_text.txt --out DIR"


@dataclass(frozen=True)
class TokenWindows(BatchSource):
    """Windows of `context` tokens (inputs) and the same shifted by one (targets)."""

    path: str
    context: int
    shift_seed: int | None = None    # None: fixed windows from offset 0 (validation)
    dtype: str = "uint16"
    input_dtype = np.int64

    @property
    def tokens(self) -> np.memmap:
        # Opened on use, not held: a DataLoader worker pickles the split, and a path travels better.
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    @property
    def token_count(self) -> int:
        return Path(self.path).stat().st_size // np.dtype(self.dtype).itemsize

    @property
    def min_tokens(self) -> int:
        """Tokens one window and its target need, at the largest offset an epoch may draw."""
        return self.context + 1 + (self.context - 1 if self.shift_seed is not None else 0)

    def __len__(self) -> int:
        return max(0, (self.token_count - self.min_tokens) // self.context + 1)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return (self.context,)

    @property
    def target_shape(self) -> tuple[int, ...]:
        return (self.context,)

    def offset(self, epoch: int) -> int:
        if self.shift_seed is None:
            return 0
        return int(np.random.default_rng((self.shift_seed, epoch)).integers(self.context))

    def take(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        starts = self.offset(epoch) + np.asarray(indices, dtype=np.int64) * self.context
        windows = self.tokens[starts[:, None] + np.arange(self.context + 1)].astype(np.int64)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def vocabulary(root: Path) -> tuple[int, str]:
    """meta.json's vocabulary size and the token files' dtype."""
    meta = root / "meta.json"
    try:
        found = json.loads(meta.read_text())
        size, dtype = found["vocab_size"], found.get("dtype", "uint16")
    except FileNotFoundError:
        raise DataError(f"data.path {str(root)!r} has no meta.json naming the vocabulary size: "
                        f"{MAKE_THEM}, or write {{\"vocab_size\": N}} there") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise DataError(f"{meta} must be JSON with an integer vocab_size, e.g. {{\"vocab_size\": 256}}") from None
    if dtype not in DTYPES:
        raise DataError(f"{meta}: dtype must be one of {', '.join(DTYPES)} (the token ids' type), got {dtype!r}")
    largest = np.iinfo(dtype).max + 1
    if not isinstance(size, int) or isinstance(size, bool) or not 1 < size <= largest:
        raise DataError(f"{meta}: vocab_size must be an integer from 2 to {largest} (tokens are {dtype}), "
                        f"got {size!r}")
    return size, dtype


def load_tokens(path: str | Path, context: int, seed: int = 0, vocab_multiple: int = 1) -> Dataset:
    """The token folder's train and val windows; the vocabulary (num_classes) padded up to a
    multiple of `vocab_multiple`, as nanoGPT pads GPT-2's 50,257 ids to 50,304: a model sized by it
    has matmuls of friendly shapes and a head tensor parallelism can split; the padded ids never
    occur in the data, so training soon gives them no probability."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path {str(root)!r} is not a folder holding {' and '.join(FILES)}: {MAKE_THEM}")
    if context < 1:
        raise DataError(f"model.context must be at least 1, got {context}")
    for name in FILES:
        if not (root / name).is_file():
            raise DataError(f"data.path {str(root)!r} has no {name}: {MAKE_THEM}")
    vocab, dtype = vocabulary(root)
    for name in FILES:
        size = (root / name).stat().st_size
        if size % np.dtype(dtype).itemsize:
            raise DataError(f"{root / name} is {size} bytes, not a whole number of {dtype} tokens: {MAKE_THEM}")
    train = TokenWindows(str(root / "train.bin"), context, shift_seed=seed, dtype=dtype)
    val = TokenWindows(str(root / "val.bin"), context, dtype=dtype)
    for name, split in zip(FILES, (train, val)):
        if len(split) < 1:
            raise DataError(f"{root / name} holds {split.token_count} tokens, fewer than the {split.min_tokens} "
                            f"one context window needs (model.context {context}): use more text, or lower "
                            f"model.context")
    return Dataset(train, val, num_classes=-(-vocab // vocab_multiple) * vocab_multiple)
