"""Turn text into the token files train.py reads: one token per byte, nothing downloaded.

    python prepare_tokens.py my_corpus.txt more_text/ --out data/tokens
    python prepare_tokens.py                     # the Python standard library's own source code

Writes OUT/train.bin and OUT/val.bin (the tokens back to back, uint16, the nanoGPT format) and
OUT/meta.json ({"vocab_size": 256}). The last --val-fraction of the bytes is held out for
validation. Folders are read recursively (.txt, .md, .rst, .py files). To use another tokenizer,
write the same three files with its token ids and its vocabulary size.
"""

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py"}


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", type=Path, help="text files or folders (default: the standard library)")
    ap.add_argument("--out", type=Path, default=Path("data/tokens"), help="folder to write (default: data/tokens)")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--max-bytes", type=int, default=200_000, help="stop reading after this many bytes")
    args = ap.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0:
        sys.exit(f"error: --val-fraction must be between 0 and 1, got {args.val_fraction}")

    inputs = args.inputs or [Path(sysconfig.get_paths()["stdlib"])]
    chunks, total = [], 0
    for file in text_files(inputs):
        data = file.read_bytes()[: args.max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= args.max_bytes:
            break
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)
    n_val = int(len(tokens) * args.val_fraction)
    if n_val < 2 or len(tokens) - n_val < 2:
        sys.exit(f"error: {len(tokens)} bytes of text is too little to split into training and validation tokens: "
                 f"give more text")
    args.out.mkdir(parents=True, exist_ok=True)
    tokens[:-n_val].tofile(args.out / "train.bin")
    tokens[-n_val:].tofile(args.out / "val.bin")
    (args.out / "meta.json").write_text(json.dumps({"vocab_size": 256, "encoding": "bytes"}) + "\n")
    print(f"wrote {len(tokens) - n_val} training and {n_val} validation tokens to {args.out}/")


if __name__ == "__main__":
    main()
