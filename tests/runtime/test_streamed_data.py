"""Data read from disk batch by batch: image folders and token files, and the batchers that stream them."""

import json
import os
import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from hvd_runtime.config import DataConfig
from hvd_runtime.data import BatchSource, DataError, load_dataset, load_image_folder, load_tokens
from hvd_runtime.image_files import ImageFiles
from hvd_runtime.tokens import TokenWindows
from hvd_runtime.torch.batches import ShardedBatches


def write_images(root, classes=("cats", "dogs"), per_class=6, size=(20, 12)):
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def write_tokens(root, tokens: np.ndarray, val: np.ndarray | None = None, vocab: int = 256, dtype: str | None = None):
    """Token files as prepare_tokens.py writes them; dtype None: a meta.json that names none (uint16)."""
    root.mkdir(parents=True, exist_ok=True)
    tokens.astype(dtype or np.uint16).tofile(root / "train.bin")
    (tokens if val is None else val).astype(dtype or np.uint16).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": vocab, **({"dtype": dtype} if dtype else {})}))


# -- image folders --------------------------------------------------------------------------------

def test_an_image_folder_holds_file_names_and_decodes_per_batch(tmp_path):
    write_images(tmp_path)
    ds = load_image_folder(tmp_path, image_size=8, val_fraction=0.25, seed=3)
    assert isinstance(ds.train, ImageFiles) and ds.train.streamed
    assert (len(ds.train), len(ds.val), ds.num_classes, ds.input_shape) == (9, 3, 2, (3, 8, 8))
    x, y = ds.val.take(np.array([2, 0]))
    assert x.shape == (2, 3, 8, 8) and x.dtype == np.float32 and y.dtype == np.int64
    # validation images are only resized: exactly what PIL gives
    with Image.open(ds.val.files[0]) as img:
        plain = np.asarray(img.convert("RGB").resize((8, 8), Image.BILINEAR), dtype=np.float32).transpose(2, 0, 1)
    np.testing.assert_array_equal(x[1], plain / 255.0)


def test_augmentation_depends_on_epoch_and_sample_only(tmp_path):
    write_images(tmp_path)
    train = load_image_folder(tmp_path, image_size=8, seed=3).train
    picks = np.arange(len(train))
    first = train.take(picks, epoch=1)[0]
    assert np.array_equal(first, train.take(picks, epoch=1)[0])                  # repeatable: exact resume
    assert np.array_equal(first[4:], train.take(picks[4:], epoch=1)[0])           # whatever batch a sample is in
    assert not np.array_equal(first, train.take(picks, epoch=2)[0])              # a new epoch, new crops and flips


def test_a_train_and_val_layout_is_used_as_given(tmp_path):
    write_images(tmp_path / "train", per_class=4)
    write_images(tmp_path / "val", per_class=2)
    ds = load_image_folder(tmp_path, image_size=8)
    assert (len(ds.train), len(ds.val), ds.classes) == (8, 4, ("cats", "dogs"))
    assert all("/val/" in f for f in ds.val.files) and ds.val.augment_seed is None


def test_bad_image_folders_are_one_line_data_errors(tmp_path):
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    with pytest.raises(DataError, match=r"has class folders but no images \(.png, .jpg.*\): use ROOT/<class>"):
        load_image_folder(tmp_path / "empty")
    write_images(tmp_path / "broken")
    good = tmp_path / "broken" / "dogs" / "0.png"
    ds = load_image_folder(tmp_path / "broken", image_size=8)
    good.write_bytes(good.read_bytes()[:60])  # the header survives, the pixels do not: found when decoded
    split = ds.train if str(good) in ds.train.files else ds.val
    with pytest.raises(DataError) as error:
        split.take(np.array([split.files.index(str(good))]))
    assert str(error.value).startswith(f"{good} is not a readable image (") and "\n" not in str(error.value)
    assert str(error.value).endswith("replace or remove it from data.path")


def test_streamed_batches_read_by_a_worker_process_equal_those_read_in_process(tmp_path):
    write_images(tmp_path, per_class=7)
    train = load_image_folder(tmp_path, image_size=8, seed=1).train
    inline = ShardedBatches(train, 4, rank=1, size=2, seed=5, workers=0)
    workers = ShardedBatches(train, 4, rank=1, size=2, seed=5, workers=2)
    got = list(workers.batches(epoch=2, consumed=4))
    want = list(inline.batches(epoch=2, consumed=4))
    assert len(got) == len(want) == inline.steps(4)
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)
    # and they are this rank's shard of the epoch, decoded
    first = inline.indices(2, 4)[:4]
    assert torch.equal(want[0][0], torch.from_numpy(train.take(first, 2)[0]))


@dataclass(frozen=True)
class WhoReads(BatchSource):
    """n samples; each read says which process read it (its pid and its parent's) and which epoch."""

    n: int
    input_dtype = np.int64
    sample_shape = (3,)

    def __len__(self) -> int:
        return self.n

    def take(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        return np.tile([os.getpid(), os.getppid(), epoch], (len(indices), 1)), np.asarray(indices, dtype=np.int64)


def test_workers_start_once_from_a_fork_server_not_from_the_threaded_rank():
    """A rank runs threads (Horovod's loop, Gloo's); a worker forked from it can inherit a held lock
    and hang (worker_context says more). Workers come from a fork server, and serve every pass."""
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)  # this process is multi-threaded, as a rank is
    busy.start()
    try:
        batches = ShardedBatches(WhoReads(40), 4, rank=0, size=1, seed=0, workers=2)
        passes = {}
        for epoch in (0, 1, 2):
            for step, (x, y) in enumerate(batches.batches(epoch=epoch)):
                passes.setdefault(epoch, []).append((x, y))
                if epoch == 1 and step == 2:
                    break  # a pass left mid-epoch (a stop, an elastic reset): the next one starts clean
    finally:
        stop.set()
    readers = {(int(pid), int(parent)) for batches_ in passes.values() for x, _ in batches_ for pid, parent, _ in x}
    assert len({pid for pid, _ in readers}) == 2, readers            # the same 2 workers all along
    assert all(pid != os.getpid() and parent != os.getpid() for pid, parent in readers), readers
    for epoch in (0, 2):  # whole passes: this epoch's batches, in this epoch's order
        assert {int(e) for x, _ in passes[epoch] for e in x[:, 2]} == {epoch}
        assert torch.equal(torch.cat([y for _, y in passes[epoch]]), torch.from_numpy(batches.indices(epoch, 0)))


def test_a_file_that_goes_bad_in_a_worker_reaches_the_rank_as_one_data_error(tmp_path):
    write_images(tmp_path)
    train = load_image_folder(tmp_path, image_size=8).train
    for file in train.files:
        (tmp_path / file).write_bytes((tmp_path / file).read_bytes()[:60])
    with pytest.raises(DataError) as error:
        list(ShardedBatches(train, 4, rank=0, size=1, workers=1).batches())
    assert "is not a readable image" in str(error.value) and "\n" not in str(error.value)


# -- token files ----------------------------------------------------------------------------------

def test_token_windows_are_inputs_and_the_next_tokens(tmp_path):
    write_tokens(tmp_path, np.arange(100) % 50, val=np.arange(30), vocab=50)
    ds = load_tokens(tmp_path, context=8, seed=0)
    assert (ds.num_classes, ds.input_shape) == (50, (8,))
    assert len(ds.val) == (30 - 1) // 8 == 3
    assert len(ds.train) == (100 - 1 - 7) // 8                      # room for a shift of up to 7
    x, y = ds.val.take(np.array([1, 0]))
    np.testing.assert_array_equal(x, [np.arange(8, 16), np.arange(0, 8)])
    np.testing.assert_array_equal(y, x + 1)
    assert x.dtype == np.int64
    offsets = {ds.train.offset(epoch) for epoch in range(20)}
    assert len(offsets) > 1 and all(0 <= o < 8 for o in offsets)
    last = np.array([len(ds.train) - 1])
    for epoch in range(20):  # the last window of any epoch still fits
        x, y = ds.train.take(last, epoch)
        assert y[0, -1] == (ds.train.offset(epoch) + len(ds.train) * 8) % 50


def test_a_vocabulary_past_uint16_reads_uint32_tokens(tmp_path):
    write_tokens(tmp_path, np.arange(100) + 70_000, vocab=70_200, dtype="uint32")
    ds = load_tokens(tmp_path, context=8)
    assert ds.num_classes == 70_200 and len(ds.val) == (100 - 1) // 8
    x, y = ds.val.take(np.array([0]))
    np.testing.assert_array_equal(x[0], np.arange(8) + 70_000)
    np.testing.assert_array_equal(y[0], np.arange(1, 9) + 70_000)


def test_the_vocabulary_pads_to_a_multiple_and_the_tokens_stay_as_written(tmp_path):
    """GPT-2's 50,257 ids as nanoGPT pads them: 50,304, a multiple of 64."""
    write_tokens(tmp_path, np.arange(100) + 50_100, vocab=50_257)
    assert load_tokens(tmp_path, context=8).num_classes == 50_257
    padded = load_tokens(tmp_path, context=8, vocab_multiple=64)
    assert padded.num_classes == 50_304
    np.testing.assert_array_equal(padded.val.take(np.array([0]))[0][0], np.arange(8) + 50_100)
    assert load_tokens(tmp_path, context=8, vocab_multiple=1).num_classes == 50_257
    write_tokens(tmp_path, np.arange(100), vocab=256)
    assert load_tokens(tmp_path, context=8, vocab_multiple=64).num_classes == 256   # a multiple already


def test_a_token_split_is_read_through_a_dataloader(tmp_path):
    write_tokens(tmp_path, np.arange(200) % 7, vocab=7)
    val = load_tokens(tmp_path, context=4).val
    batches = list(ShardedBatches(val, 5, rank=0, size=1, train=False, workers=1))
    x = torch.cat([b[0] for b in batches])
    assert x.shape == (len(val), 4) and torch.equal(x[:, 0], torch.arange(0, 4 * len(val), 4) % 7)


@pytest.mark.parametrize("make,problem", [
    (lambda root: None, "is not a folder holding train.bin and val.bin: make them with: python prepare_tokens.py"),
    (lambda root: root.mkdir(), "has no train.bin: make them with: python prepare_tokens.py"),
    (lambda root: write_tokens(root, np.arange(10)) or (root / "meta.json").unlink(),
     "has no meta.json naming the vocabulary size"),
    (lambda root: write_tokens(root, np.arange(10)) or (root / "meta.json").write_text("{}"),
     "meta.json must be JSON with an integer vocab_size"),
    (lambda root: write_tokens(root, np.arange(10), vocab=70000), "vocab_size must be an integer from 2 to 65536"),
    (lambda root: write_tokens(root, np.arange(10)) or (root / "val.bin").write_bytes(b"abc"),
     "val.bin is 3 bytes, not a whole number of uint16 tokens"),
    (lambda root: write_tokens(root, np.arange(10), dtype="uint32") or (root / "val.bin").write_bytes(b"abcdef"),
     "val.bin is 6 bytes, not a whole number of uint32 tokens"),
    (lambda root: write_tokens(root, np.arange(10), dtype="int8"), "dtype must be one of uint16, uint32"),
    (lambda root: write_tokens(root, np.arange(10), vocab=70000, dtype="uint16"),
     "vocab_size must be an integer from 2 to 65536 (tokens are uint16)"),
    (lambda root: write_tokens(root, np.arange(12)), "train.bin holds 12 tokens, fewer than the 16 one context window "
                                                     "needs (model.context 8): use more text, or lower model.context"),
])
def test_bad_token_folders_are_one_line_data_errors(tmp_path, make, problem):
    root = tmp_path / "tokens"
    make(root)
    with pytest.raises(DataError) as error:
        load_tokens(root, context=8)
    assert problem in str(error.value) and "\n" not in str(error.value)


def test_tokens_need_a_language_model():
    with pytest.raises(DataError, match="data.source tokens feeds a language model: generate one with hvdgen new "
                                        "--model gpt"):
        load_dataset(DataConfig(source="tokens", path="x"))


def test_token_windows_travel_as_a_path(tmp_path):
    """A DataLoader worker receives the split pickled: it must not carry the mapped file."""
    import pickle

    write_tokens(tmp_path, np.arange(100))
    split = load_tokens(tmp_path, context=8).train
    assert isinstance(split, TokenWindows) and len(pickle.dumps(split)) < 300
