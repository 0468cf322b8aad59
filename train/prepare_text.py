"""`python -m train prepare-text <text files or directories> <out dir>`: text to token files
for `data=tokens data.root=<out dir>` (train/data/tokens.py reads them, train/data/tokenize.py
writes them). Run it once, on a login node: it needs no GPU and no download.

    python -m train prepare-text notes/*.txt corpus/ /scratch/$USER/tokens
    python -m train data=tokens data.root=/scratch/$USER/tokens model=gpt task=language_model
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".csv", ".tex", ".html")
"""What a directory argument contributes: its files with these suffixes, recursively."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train prepare-text",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path,
                   help=f"text files, or directories (their {', '.join(TEXT_SUFFIXES)} files)")
    p.add_argument("out", type=Path, help="the directory to write train.bin, val.bin, meta.json")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a `tokenizers` JSON file, or a directory holding its tokenizer.json "
                        "(default: bytes, vocabulary 256)")
    p.add_argument("--train-tokenizer", choices=["bpe"], default=None,
                   help="train a byte-level BPE on these files first (the `tokenizers` "
                        "package, offline), written as <out>/tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="--train-tokenizer's vocabulary (default 4096)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the end of each file that goes to val.bin (default 0.1)")
    p.add_argument("--test-fraction", type=float, default=0.0,
                   help="the very end of each file that goes to test.bin (default 0: none)")
    return p.parse_args(argv)


def refuse(line: str) -> NoReturn:
    """Bad input: one line and exit code 2, as every command of the service."""
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(2)


def files_of(inputs: list[Path]) -> list[Path]:
    """The files named, and those under the directories named, in a stable order."""
    found: list[Path] = []
    for item in inputs:
        if item.is_dir():
            found += sorted(p for p in item.rglob("*")
                            if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        elif item.is_file():
            found.append(item)
        else:
            refuse(f"{item} is neither a file nor a directory.")
    if not found:
        refuse("no text files found in " + ", ".join(map(str, inputs)))
    return found


def main(argv: list[str] | None = None) -> None:
    os.umask(0o027 if os.environ.get("TRAIN_GROUP_READABLE") == "1" else 0o077)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not (0 < args.val_fraction < 1 and 0 <= args.test_fraction < 1
            and args.val_fraction + args.test_fraction < 1):
        refuse("--val-fraction must be in (0, 1), --test-fraction in [0, 1), and the two "
               "together below 1.")
    from train.data import tokenize
    from train.data.tokens import TokenDataError

    if args.tokenizer is not None and args.train_tokenizer is not None:
        refuse("give --tokenizer (one you have) or --train-tokenizer (one trained on these "
               "files), not both.")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        refuse(f"OUT {out} is a file: give a folder's path.")
    made = not out.exists()
    try:
        files = files_of(args.inputs)
        if args.train_tokenizer is not None:
            tok: tokenize.Tokenizer = tokenize.train_bpe(files, args.vocab_size, args.out)
        elif args.tokenizer is not None:
            tok = tokenize.FileTokenizer(args.tokenizer)
        else:
            tok = tokenize.ByteTokenizer()
        done = tokenize.prepare(files, args.out, tok, args.val_fraction, args.test_fraction)
    except TokenDataError as e:
        refuse(str(e))
    except OSError as e:
        refuse(f"{e.filename or out}: {e.strerror}: give a folder you can write to.")
    short = {split: n for split, n in done.tokens.items() if split != "test" and n < 2}
    if short:
        if made:  # nothing half-made: no token files a job would refuse later
            shutil.rmtree(out, ignore_errors=True)
        refuse(f"the text gives {', '.join(f'{k} {v}' for k, v in short.items())} tokens: each "
               "of train and val needs at least 2; give more text.")
    counts = ", ".join(f"{split} {n:,}" for split, n in done.tokens.items())
    print(f"prepare_text: {len(files)} files -> {done.out}: {counts} tokens ({done.dtype}, "
          f"vocabulary {done.vocab_size}, tokenizer {tok.name})")
    print(f"train on it: python -m train data=tokens data.root={done.out} model=gpt "
          "task=language_model")


if __name__ == "__main__":
    main()
