"""Text to token files (`python -m train prepare-text`), and the tokenizers that read them back.

The default tokenizer is byte-level: a file's bytes are its tokens (vocabulary 256), so any
text in any encoding is tokenized without a download or a trained vocabulary. A `tokenizers`
JSON file the user has (e.g. a GPT-2 BPE saved by Hugging Face `tokenizers`, or a directory
holding its tokenizer.json) is one option; a byte-level BPE trained on the corpus itself
(`train_bpe`, offline) the other, written as tokenizer.json beside the token files. Both need
the `tokenizers` package (the `hf` extra).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from train.data.tokens import META, TokenDataError

BYTES = "bytes"


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, data: bytes) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    name, vocab_size = BYTES, 256

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


TOKENIZER_FILE = "tokenizer.json"
"""A tokenizer's file in a directory (save_pretrained's, or the one prepare-text trained)."""


def _tokenizers(what: str) -> Any:
    try:
        import tokenizers  # type: ignore[import-not-found]
    except ImportError:
        raise TokenDataError(f"{what} needs the `tokenizers` package: pip install -e '.[hf]' "
                             "(or leave the tokenizer out: bytes).") from None
    return tokenizers


class FileTokenizer:
    """A `tokenizers` JSON file, or a directory holding one (its package imported only here)."""

    def __init__(self, path: Path) -> None:
        path = path / TOKENIZER_FILE if path.is_dir() else path
        HFTokenizer = _tokenizers(f"the tokenizer {path}").Tokenizer
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library's own error types: one line
            raise TokenDataError(f"{path} is not a `tokenizers` JSON file: {e}") from None
        self.name, self.vocab_size = str(path.resolve()), int(self._tok.get_vocab_size())

    def encode(self, data: bytes) -> list[int]:
        return list(self._tok.encode(data.decode("utf-8", errors="replace")).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids]))


def tokenizer(name: str) -> Tokenizer:
    """The tokenizer meta.json names (the byte-level one, or a tokenizers file)."""
    return ByteTokenizer() if name == BYTES else FileTokenizer(Path(name))


PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>")
"""A tokenizer's padding token, by the names BERT's, T5's and prepare-text's BPE use (also
the one a run's hf_model/ export names: train/engine/outputs.py)."""


class TextEncoder:
    """Texts to token ids of one length (padded with the tokenizer's pad token, truncated), for
    a text column of data=arrow: made in the launching process, pickled into each DataLoader
    worker, which loads the tokenizer itself on first use."""

    def __init__(self, path: str, max_length: int, by_words: bool = False,
                 ignore_index: int = -100) -> None:
        self.path, self.max_length = path, max_length
        self.by_words, self.ignore_index = by_words, ignore_index
        """`by_words`: each text is a list of words with a target each (`words`)."""
        loaded = FileTokenizer(Path(path).expanduser())  # checks it loads, once
        tok, self.file = loaded._tok, loaded.name
        """`file`: the tokenizers JSON file itself (the run's export carries it)."""
        self.vocab_size = int(tok.get_vocab_size())
        found = [(t, tok.token_to_id(t)) for t in PAD_TOKENS if tok.token_to_id(t) is not None]
        if not found:
            raise TokenDataError(f"data.tokenizer={path} has no padding token "
                                 f"({', '.join(PAD_TOKENS)}): texts of one length need one.")
        self.pad_token, self.pad_id = found[0]
        self._tok: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def _loaded(self) -> Any:
        if self._tok is None:
            self._tok = FileTokenizer(Path(self.path).expanduser())._tok
            self._tok.enable_truncation(self.max_length)
            self._tok.enable_padding(length=self.max_length, pad_id=self.pad_id,
                                     pad_token=self.pad_token)
        return self._tok

    def __call__(self, texts: list[str]) -> np.ndarray:
        return np.asarray([e.ids for e in self._loaded().encode_batch(texts)], dtype=np.int64)

    def words(self, texts: list[list[str]], tags: list[list[int]]
              ) -> tuple[np.ndarray, np.ndarray]:
        """Texts split into words, and a tag per word, as token ids and a tag per token: a
        word's first piece carries its tag, its other pieces, special tokens and the padding
        `ignore_index` (the transformers token-classification recipe)."""
        encoded = self._loaded().encode_batch(texts, is_pretokenized=True)
        ids = np.asarray([e.ids for e in encoded], dtype=np.int64)
        labels = np.full(ids.shape, self.ignore_index, dtype=np.int64)
        for row, (encoding, row_tags) in enumerate(zip(encoded, tags, strict=True)):
            previous = None
            for position, word in enumerate(encoding.word_ids):
                if word is not None and word != previous:
                    labels[row, position] = row_tags[word]
                previous = word
        return ids, labels


def train_bpe(files: Sequence[Path], vocab_size: int, out: Path) -> FileTokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on the files' text (GPT-2's scheme:
    every byte is a token to start with, so no text is out of vocabulary), and <pad> (id 0)
    for padded texts (TextEncoder), saved as <out>/tokenizer.json."""
    if vocab_size <= 256:
        raise TokenDataError(f"--vocab-size {vocab_size}: a byte-level BPE starts from the 256 "
                             "bytes; give more (e.g. 4096).")
    tk = _tokenizers("--train-tokenizer bpe")
    bpe = tk.Tokenizer(tk.models.BPE())
    bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                     special_tokens=["<pad>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    texts = (p.read_bytes().decode("utf-8", errors="replace") for p in files)
    bpe.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    bpe.save(str(out / TOKENIZER_FILE))
    return FileTokenizer(out / TOKENIZER_FILE)


@dataclass(frozen=True)
class Prepared:
    out: Path
    tokens: dict[str, int]
    vocab_size: int
    dtype: str


def prepare(files: Iterable[Path], out: Path, tok: Tokenizer, val_fraction: float = 0.1,
            test_fraction: float = 0.0) -> Prepared:
    """Each file's tokens, in order: its first part to train.bin, the next val_fraction to
    val.bin, the last test_fraction to test.bin (test.bin only if test_fraction > 0). One file
    is held in memory at a time; the token files are appended to as they go."""
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    splits = ["train", "val", *(["test"] if test_fraction > 0 else [])]
    out.mkdir(parents=True, exist_ok=True)
    counts = dict.fromkeys(splits, 0)
    sinks = {s: (out / f"{s}.bin").open("wb") for s in splits}
    try:
        for path in files:
            ids = np.asarray(tok.encode(path.read_bytes()), dtype=dtype)
            n_test = round(len(ids) * test_fraction)
            n_val = round(len(ids) * val_fraction)
            cuts = {"train": ids[:len(ids) - n_val - n_test],
                    "val": ids[len(ids) - n_val - n_test:len(ids) - n_test],
                    "test": ids[len(ids) - n_test:]}
            for split in splits:
                cuts[split].tofile(sinks[split])
                counts[split] += len(cuts[split])
    finally:
        for sink in sinks.values():
            sink.close()
    meta: dict[str, Any] = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": dtype,
                            "tokens": counts, "sources": [str(p) for p in files]}
    _write_json(out / META, meta)
    return Prepared(out, counts, tok.vocab_size, dtype)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)  # meta.json last, and whole: its presence says the files are done
