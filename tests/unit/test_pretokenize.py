"""data.tokenize=map's cache (train/data/pretokenize.py) in-process and across processes: made
once, reused, remade when what the ids depend on changes, and made once by ranks that start
together on one node. A whole run: tests/e2e/test_hf.py; 2 Slurm nodes:
tests/cluster/test_hf_slurm.py."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from tests.conftest import SENTENCES

pytest.importorskip("tokenizers", reason="data.tokenizer needs the hf extra (make setup has it)")


def _tokenized(root: str, tokenizer: str, max_length: int, out: str) -> list[list[int]]:
    from train.data import arrow, pretokenize
    from train.data.tokenize import TextEncoder

    layout = arrow.find(root)
    cached = pretokenize.tokenized(layout, "text", TextEncoder(tokenizer, max_length), out,
                                   arrow.digest(layout))
    split = arrow.open_split(cached.splits["val"])
    return [list(map(int, ids)) for ids in split[pretokenize.COLUMN]]


def test_the_cache_holds_the_workers_ids_and_is_made_once_per_change(
        sentences: Path, bpe_tokens: Path, tmp_path: Path) -> None:
    from train.data import arrow
    from train.data.tokenize import TextEncoder

    out = tmp_path / "cache"
    first = _tokenized(str(sentences), str(bpe_tokens), 16, str(out))
    texts = arrow.open_split(arrow.find(sentences).splits["val"])["text"]
    assert first == TextEncoder(str(bpe_tokens), 16)(texts).tolist()  # the workers' ids
    assert _tokenized(str(sentences), str(bpe_tokens), 16, str(out)) == first
    assert len((out / "tokenize.log").read_text().splitlines()) == 1  # reused, not remade
    longer = _tokenized(str(sentences), str(bpe_tokens), 24, str(out))
    assert len(longer[0]) == 24 and len((out / "tokenize.log").read_text().splitlines()) == 2
    assert len(list(out.glob("set-*"))) == 2 and not list(out.glob(".*.tmp"))
    labels = arrow.open_split(next(out.glob("set-*")) / "validation")["label"]
    assert len(labels) == SENTENCES // 5  # the other columns kept, rows in their order


def test_ranks_starting_together_on_one_node_tokenize_once(
        sentences: Path, bpe_tokens: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    args = (str(sentences), str(bpe_tokens), 16, str(out))
    # Forked, not spawned: three fresh interpreters importing torch and datasets were four
    # seconds of the quick layer; the cache's lock and rename are the same across forks.
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.starmap(_tokenized, [args] * 3)
    assert results[0] == results[1] == results[2]
    assert len((out / "tokenize.log").read_text().splitlines()) == 1


def test_pre_flight_names_a_cache_that_cannot_be_written(tmp_path: Path) -> None:
    from train.data.pretokenize import writable_problem

    data = tmp_path / "data"
    data.mkdir()
    assert writable_problem(data, None) is None
    assert writable_problem(data, str(tmp_path / "new" / "deeper")) is None  # made on the node
    (tmp_path / "file").write_text("")
    problem = writable_problem(data, str(tmp_path / "file" / "cache"))
    assert problem and f"caches the tokenized set in {tmp_path / 'file' / 'cache'}" in problem
    assert "set data.tokenized_to=<a writable directory" in problem
    if os.geteuid() != 0:  # root writes anywhere
        data.chmod(0o555)
        try:
            assert "cannot be written" in (writable_problem(data, None) or "")
        finally:
            data.chmod(0o755)

