"""A GPT project's prepare_tokens.py (templates/base): text to the token files train.py reads,
one token per byte or a byte-level BPE it learns from the same text."""

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

from hvd_runtime.data import load_tokens

SCRIPT = Path(__file__).resolve().parents[2] / "templates" / "base" / "prepare_tokens.py"
main = runpy.run_path(str(SCRIPT))["main"]
TEXT = Path(__file__).resolve().parents[2] / "docs"   # English and code, in Markdown


def test_bytes_are_one_token_each(tmp_path):
    main([str(TEXT), "--out", str(tmp_path), "--max-bytes", "20000"])
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta == {"vocab_size": 256, "encoding": "bytes", "dtype": "uint16"}
    train, val = (np.fromfile(tmp_path / name, dtype=np.uint16) for name in ("train.bin", "val.bin"))
    assert (len(train), len(val)) == (18000, 2000) and not (tmp_path / "tokenizer.json").exists()


def test_a_bpe_learned_from_the_text_encodes_it_in_fewer_tokens_and_decodes_it_back(tmp_path):
    from tokenizers import Tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for page in sorted(TEXT.glob("*.md"))[:6]:
        (corpus / page.name).write_text(page.read_text())
    text_bytes = sum(min(p.stat().st_size, 200_000) for p in corpus.iterdir())
    out = tmp_path / "tokens"
    main([str(corpus), "--tokenizer", "bpe", "--vocab-size", "1024", "--out", str(out)])
    meta = json.loads((out / "meta.json").read_text())
    assert meta == {"vocab_size": 1024, "encoding": "bpe", "dtype": "uint16", "tokenizer": "tokenizer.json"}
    train, val = (np.fromfile(out / name, dtype=np.uint16) for name in ("train.bin", "val.bin"))
    assert max(train.max(), val.max()) < 1024
    assert (len(train) + len(val)) * 2.5 < min(text_bytes, 200_000), "a BPE token covers several bytes"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    end = tokenizer.token_to_id("<|endoftext|>")
    ids = np.concatenate([train, val]).tolist()
    assert ids.count(end) == 6, "each file ends with <|endoftext|>"
    documents = tokenizer.decode(ids, skip_special_tokens=False).split("<|endoftext|>")
    assert documents[:-1] == [p.read_text() for p in sorted(corpus.iterdir())]
    ds = load_tokens(out, context=16)
    assert ds.num_classes == 1024 and len(ds.val) > 0


def test_bytes_after_a_bpe_leave_no_stale_tokenizer(tmp_path):
    main([str(TEXT), "--tokenizer", "bpe", "--vocab-size", "300", "--out", str(tmp_path), "--max-bytes", "20000"])
    assert (tmp_path / "tokenizer.json").exists()
    main([str(TEXT), "--out", str(tmp_path), "--max-bytes", "20000"])
    assert not (tmp_path / "tokenizer.json").exists()


@pytest.mark.parametrize("args, problem", [
    (["--vocab-size", "300"], "error: --vocab-size is for --tokenizer bpe: bytes always have 256 tokens"),
    (["--tokenizer", "bpe", "--vocab-size", "100"], "error: --vocab-size must be from 258 to 4294967296"),
    (["--tokenizer", "bpe", "--max-bytes", "3"], "error: 3 tokens of text is too little to split"),
])
def test_bad_options_are_one_line_and_write_nothing(tmp_path, args, problem):
    out = tmp_path / "tokens"
    with pytest.raises(SystemExit) as stopped:
        main([str(TEXT), "--out", str(out), *args])
    assert str(stopped.value).startswith(problem) and "\n" not in str(stopped.value)
    assert not out.exists()


def test_an_empty_folder_or_a_missing_tokenizers_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "tokens"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path / "empty"), "--out", str(out)])
    assert str(stopped.value) == ("error: 0 tokens of text is too little to split into training and validation "
                                  "tokens: give more text")
    monkeypatch.setitem(sys.modules, "tokenizers", None)   # as where it is not installed
    with pytest.raises(SystemExit) as stopped:
        main([str(TEXT), "--out", str(out), "--tokenizer", "bpe"])
    assert str(stopped.value) == ("error: --tokenizer bpe needs the tokenizers package: pip install tokenizers "
                                  "(or use --tokenizer bytes)")
    assert not out.exists()
