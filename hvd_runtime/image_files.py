"""An image folder read from disk batch by batch: decoded, resized and augmented per sample.

Only the file list lives in memory, so a folder far larger than memory trains. The batchers run
`take` in worker processes (torch DataLoader workers, tf.data's parallel map), so decoding
overlaps training. Augmentation (random crop from a zero-padded image, horizontal flip) draws
from a generator seeded by (seed, epoch, sample): a resumed or resized job sees exactly the
images an uninterrupted one does, whichever worker decodes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hvd_runtime.dataset import BatchSource, Dataset, DataError, split_train_val

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
LAYOUT = "use ROOT/<class>/<image files>, or ROOT/train/<class>/... with ROOT/val/<class>/..."


@dataclass(frozen=True)
class ImageFiles(BatchSource):
    """Images and labels of one split; `augment_seed` None means no augmentation (validation)."""

    files: tuple[str, ...]
    labels: np.ndarray          # int64, one per file
    image_size: int
    augment_seed: int | None = None

    def __len__(self) -> int:
        return len(self.files)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return (3, self.image_size, self.image_size)

    def take(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        x = np.empty((len(indices), *self.sample_shape), dtype=np.float32)
        for row, i in enumerate(indices):
            x[row] = self._image(int(i), epoch)
        return x, self.labels[indices]

    def _image(self, i: int, epoch: int) -> np.ndarray:
        from PIL import Image

        try:
            with Image.open(self.files[i]) as img:
                rgb = img.convert("RGB").resize((self.image_size, self.image_size), Image.BILINEAR)
        except OSError as exc:  # truncated or corrupt past its header
            raise DataError(f"{self.files[i]} is not a readable image ({exc}): replace or remove it from data.path") \
                from None
        chw = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0
        if self.augment_seed is None:
            return chw
        rng = np.random.default_rng((self.augment_seed, epoch, i))
        pad = max(1, self.image_size // 8)
        padded = np.pad(chw, ((0, 0), (pad, pad), (pad, pad)))
        top, left = rng.integers(0, 2 * pad + 1, size=2)
        crop = padded[:, top:top + self.image_size, left:left + self.image_size]
        return np.ascontiguousarray(crop[:, :, ::-1] if rng.random() < 0.5 else crop)


def _class_folders(root: Path) -> list[str]:
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def _list_images(root: Path, classes: list[str]) -> tuple[list[str], list[int]]:
    """Every image under root/<class>/, each opened once to read its header (not decoded)."""
    from PIL import Image

    files, labels = [], []
    for label, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        for file in sorted(folder.iterdir()):
            if file.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                with Image.open(file):
                    pass
            except OSError as exc:  # PIL's UnidentifiedImageError is one
                raise DataError(f"{file} is not a readable image ({exc}): replace or remove it from data.path") \
                    from None
            files.append(str(file))
            labels.append(label)
    return files, labels


def load_image_folder(path: str | Path, image_size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """The folder's images as a streamed Dataset; classes are the sub-folder names, sorted."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path {str(root)!r} is not a folder: {LAYOUT}")
    if image_size < 1:
        raise DataError(f"data.image_size must be at least 1, got {image_size}")
    split_given = (root / "train").is_dir() and (root / "val").is_dir()
    classes = _class_folders(root / "train" if split_given else root)
    if not classes:
        raise DataError(f"data.path {str(root)!r} has no class sub-folders: {LAYOUT}")
    if split_given:
        parts = [_list_images(root / part, classes) for part in ("train", "val")]
    else:
        files, labels = _list_images(root, classes)
        parts = [([], [])]
        if files:  # held out as for in-memory data: a seeded shuffle, the same on every rank
            order = np.arange(len(files))
            parts = [([files[i] for i in split.x], [labels[i] for i in split.x])
                     for split in split_train_val(order, order, val_fraction, seed)]
    if not all(files for files, _ in parts):
        raise DataError(f"data.path {str(root)!r} has class folders but no images ({', '.join(IMAGE_SUFFIXES)}): "
                        f"{LAYOUT}")
    (train_files, train_labels), (val_files, val_labels) = parts
    return Dataset(ImageFiles(tuple(train_files), np.asarray(train_labels, dtype=np.int64), image_size, seed),
                   ImageFiles(tuple(val_files), np.asarray(val_labels, dtype=np.int64), image_size),
                   num_classes=len(classes), classes=tuple(classes))
