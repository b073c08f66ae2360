"""Turn text into the token files train.py reads: one token per byte, or a BPE learned from the text.

    python prepare_tokens.py my_corpus.txt more_text/ --out data/tokens
    python prepare_tokens.py                     # the Python standard library's own source code
    python prepare_tokens.py my_corpus.txt --tokenizer bpe --vocab-size 8192 --out data/tokens

Writes OUT/train.bin and OUT/val.bin (the tokens back to back, the nanoGPT format: uint16, or
uint32 for a vocabulary past 65536) and OUT/meta.json (the vocabulary size and that type). The
last --val-fraction of the tokens is held out for validation. Folders are read recursively (.txt,
.md, .rst, .py files).

`--tokenizer bytes` (the default) makes one token of each byte: 256 of them, nothing to learn,
right for a first run. `--tokenizer bpe` learns a byte-level BPE (GPT-2's kind: any text encodes,
no unknown token) from the same text with Hugging Face `tokenizers`, offline; a token then
covers three to four bytes of English or code, so a context window sees that much more text.
It stops at --vocab-size or when no pair of tokens is left to merge, ends every file with
`<|endoftext|>`, and saves itself as OUT/tokenizer.json, to turn ids back into text:
`tokenizers.Tokenizer.from_file("data/tokens/tokenizer.json").decode(ids)`. Another tokenizer
works too: write the same three files with its ids and its vocabulary size.
"""

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py"}
END_OF_TEXT = "<|endoftext|>"


def text_files(paths: list[Path]) -> list[Path]:
    files = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            sys.exit(f"error: {path} is neither a file nor a folder: give text files or folders of them")
    return files


def read_texts(inputs: list[Path], max_bytes: int) -> list[bytes]:
    """Each file's bytes, until max_bytes in all."""
    chunks, total = [], 0
    for file in text_files(inputs):
        data = file.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return chunks


def bpe_tokens(chunks: list[bytes], vocab_size: int):
    """The ids of a byte-level BPE learned from `chunks`, and the tokenizer."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        sys.exit("error: --tokenizer bpe needs the tokenizers package: pip install tokenizers "
                 "(or use --tokenizer bytes)")
    texts = [chunk.decode("utf-8", errors="replace") for chunk in chunks]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids = [i for encoding in tokenizer.encode_batch(texts) for i in (*encoding.ids, end)]
    return np.asarray(ids, dtype=np.int64), tokenizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", type=Path, help="text files or folders (default: the standard library)")
    ap.add_argument("--out", type=Path, default=Path("data/tokens"), help="folder to write (default: data/tokens)")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--max-bytes", type=int, default=200_000, help="stop reading after this many bytes")
    ap.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes",
                    help="one token per byte (default), or a byte-level BPE learned from the text")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="--tokenizer bpe: the most tokens it learns (default 8192)")
    args = ap.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0:
        sys.exit(f"error: --val-fraction must be between 0 and 1, got {args.val_fraction}")
    if args.vocab_size is not None and args.tokenizer != "bpe":
        sys.exit("error: --vocab-size is for --tokenizer bpe: bytes always have 256 tokens")
    vocab_size = 8192 if args.vocab_size is None else args.vocab_size
    if not 257 < vocab_size <= 2 ** 32:
        sys.exit(f"error: --vocab-size must be from 258 to {2 ** 32} (the 256 bytes, <|endoftext|> and at least one "
                 f"merge), got {vocab_size}")

    chunks = read_texts(args.inputs or [Path(sysconfig.get_paths()["stdlib"])], args.max_bytes)
    tokenizer = None
    if args.tokenizer == "bpe" and sum(map(len, chunks)):
        tokens, tokenizer = bpe_tokens(chunks, vocab_size)
        vocab_size = tokenizer.get_vocab_size()
    else:
        tokens, vocab_size = np.frombuffer(b"".join(chunks), dtype=np.uint8), 256
    n_val = int(len(tokens) * args.val_fraction)
    if n_val < 2 or len(tokens) - n_val < 2:
        sys.exit(f"error: {len(tokens)} tokens of text is too little to split into training and validation tokens: "
                 f"give more text")
    dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"
    tokens = tokens.astype(dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    tokens[:-n_val].tofile(args.out / "train.bin")
    tokens[-n_val:].tofile(args.out / "val.bin")
    meta = {"vocab_size": vocab_size, "encoding": args.tokenizer, "dtype": dtype}
    if tokenizer is not None:
        tokenizer.save(str(args.out / "tokenizer.json"))
        meta["tokenizer"] = "tokenizer.json"
    else:
        (args.out / "tokenizer.json").unlink(missing_ok=True)   # an earlier BPE's, not these tokens
    (args.out / "meta.json").write_text(json.dumps(meta) + "\n")
    print(f"wrote {len(tokens) - n_val} training and {n_val} validation tokens to {args.out}/ "
          f"({args.tokenizer}, a vocabulary of {vocab_size})")


if __name__ == "__main__":
    main()
