"""Token data, the GPT model and the language-model task, in process: windows cover every token
once, truncated files and out-of-vocabulary ids are named, the loss counts real tokens only."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from train.data import tokenize, tokens
from train.models.gpt import GPT
from train.tasks.base import summed
from train.tasks.language_model import LanguageModel


def _prepare(tmp_path: Path, text: bytes, **fractions: float) -> Path:
    source = tmp_path / "corpus.txt"
    source.write_bytes(text)
    out = tmp_path / "tokens"
    tokenize.prepare([source], out, tokenize.ByteTokenizer(), **fractions)
    return out


def test_prepare_splits_each_file_and_records_what_it_wrote(tmp_path: Path) -> None:
    out = _prepare(tmp_path, bytes(range(200)) * 5, val_fraction=0.1, test_fraction=0.1)
    meta = tokens.read_meta(out)
    assert meta.tokens == {"train": 800, "val": 100, "test": 100}
    assert (meta.tokenizer, meta.vocab_size, meta.dtype) == ("bytes", 256, "uint16")
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    test = np.fromfile(out / "test.bin", dtype=np.uint16)
    assert train.tolist() == list(range(200)) * 4 and test.tolist() == list(range(100, 200))


@pytest.mark.parametrize(("count", "seq_len", "train_windows", "eval_windows"),
                         [(101, 10, 10, 10), (100, 10, 9, 10), (11, 10, 1, 1), (37, 8, 4, 5)])
def test_windows_train_whole_and_evaluate_every_token_once(
        tmp_path: Path, count: int, seq_len: int, train_windows: int, eval_windows: int) -> None:
    path = tmp_path / "t.bin"
    np.arange(count, dtype=np.uint16).tofile(path)
    train = tokens.TokenWindows(path, "uint16", count, seq_len, cover_all=False)
    val = tokens.TokenWindows(path, "uint16", count, seq_len, cover_all=True)
    assert (len(train), len(val)) == (train_windows, eval_windows)
    targets = torch.cat([val[i][1] for i in range(len(val))])
    counted = targets[targets != tokens.IGNORE_INDEX]
    assert counted.tolist() == list(range(1, count))  # every token but the first, once
    inputs, target = train[len(train) - 1]
    assert torch.equal(inputs[1:], target[:-1]) and len(inputs) == seq_len


def test_a_truncated_file_and_an_id_outside_the_vocabulary_are_named(tmp_path: Path) -> None:
    out = _prepare(tmp_path, b"hello world, " * 40)
    assert tokens.check(out, seq_len=16).vocab_size == 256
    with pytest.raises(tokens.TokenDataError, match="token id 119, outside the vocabulary of 100"):
        tokens.check(out, seq_len=16, vocab_limit=100)  # 'w' is 119
    with pytest.raises(tokens.TokenDataError, match="fewer than one window"):
        tokens.check(out, seq_len=10_000)
    with (out / "train.bin").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(tokens.TokenDataError, match="train.bin holds 100 bytes"):
        tokens.read_meta(out)
    with pytest.raises(tokens.TokenDataError, match="no meta.json there"):
        tokens.read_meta(tmp_path)


def test_gpt_is_causal_and_counts_its_flops_as_nanogpt() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=50, seq_len=16, n_layer=2, n_head=2, n_embd=32).eval()
    idx = torch.randint(0, 50, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 50)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 50  # the future cannot change the past
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)
    assert model.lm_head.weight is model.wte.weight  # tied
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 32 * 16
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_the_language_model_loss_counts_only_real_tokens() -> None:
    task = LanguageModel()
    task.setup(summed(torch.nn.CrossEntropyLoss(ignore_index=-100)), 5, [])
    logits = torch.zeros(2, 3, 5)  # uniform: ln 5 per token
    target = torch.tensor([[1, 2, 3], [4, -100, -100]])
    loss, sums = task.step(logits, target)
    assert int(sums["items"]) == 4 and sums["samples"] == 2
    assert float(loss) == pytest.approx(4 * math.log(5))
    metrics = task.finalize({"loss": float(loss), "items": 4, "samples": 2})
    assert metrics["loss"] == pytest.approx(math.log(5))
    assert metrics["perplexity"] == pytest.approx(5.0)
    assert task.output_problem(torch.zeros(2, 3, 4), target, None) is not None
    assert task.output_problem(logits, target, None) is None


@pytest.mark.parametrize(("n", "world", "epoch"), [(10, 3, 0), (7, 2, 5), (64, 4, 1), (5, 8, 0)])
def test_the_window_sampler_gives_distributed_samplers_order(n: int, world: int,
                                                              epoch: int) -> None:
    """The same shuffle, padding and shards (so the order of an epoch is the one every
    DistributedSampler-based resume expects), from a tensor instead of a list."""
    from torch.utils.data import DistributedSampler

    data = list(range(n))
    for rank in range(world):
        mine = tokens.WindowSampler(data, num_replicas=world, rank=rank, seed=3)
        theirs = DistributedSampler(data, num_replicas=world, rank=rank, seed=3)
        mine.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(mine) == list(theirs) and len(mine) == len(theirs)


def test_a_bpe_trained_on_the_corpus_reads_it_back_in_fewer_tokens(tmp_path: Path) -> None:
    """prepare-text --train-tokenizer bpe: a byte-level BPE of the asked vocabulary, trained
    on the files and written beside the tokens, named in meta.json; its ids decode to the text
    again; --tokenizer <that directory> tokenizes the same files to the same ids."""
    import pydoc

    from train.prepare_text import main

    main([pydoc.__file__, str(tmp_path / "bpe"), "--train-tokenizer", "bpe",
          "--vocab-size", "300"])
    meta = tokens.read_meta(tmp_path / "bpe")
    assert meta.vocab_size == 300
    assert meta.tokenizer == str((tmp_path / "bpe" / tokenize.TOKENIZER_FILE).resolve())
    text = Path(pydoc.__file__).read_bytes()
    assert sum(meta.tokens.values()) < len(text) / 1.5  # merges learnt from the corpus
    codec = tokenize.tokenizer(meta.tokenizer)
    sample = text[:2000]
    assert codec.decode(codec.encode(sample)).encode() == sample
    main([pydoc.__file__, str(tmp_path / "again"), "--tokenizer", str(tmp_path / "bpe")])
    assert (tmp_path / "again" / "train.bin").read_bytes() == \
        (tmp_path / "bpe" / "train.bin").read_bytes()


@pytest.mark.parametrize(("extra", "expected"), [
    (["--train-tokenizer", "bpe", "--vocab-size", "256"], "--vocab-size 256: a byte-level BPE"),
    (["--train-tokenizer", "bpe", "--tokenizer", "x.json"], "give --tokenizer (one you have) or"),
])
def test_a_tokenizer_that_cannot_be_trained_is_refused(
        tmp_path: Path, extra: list[str], expected: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from train.prepare_text import main

    (tmp_path / "a.txt").write_text("some text\n" * 50)
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path / "a.txt"), str(tmp_path / "out"), *extra])
    [line] = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line.startswith("error: ") and expected in line, line
    assert not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.parametrize(("text", "out", "expected"), [
    ("", "out", "the text gives train 0, val 0 tokens: each of train and val needs at least 2"),
    ("ab", "out", "the text gives val 0 tokens"),
    ("some text\n" * 50, "a.txt", "a.txt is a file: give a folder's path."),
])
def test_text_too_short_or_an_out_that_is_a_file_is_refused_leaving_nothing(
        tmp_path: Path, text: str, out: str, expected: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused in one line (exit 2) with nothing written, not token files that every job on
    them would refuse later."""
    from train.prepare_text import main

    (tmp_path / "a.txt").write_text(text)
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path / "a.txt"), str(tmp_path / out)])
    [line] = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line.startswith("error: ") and expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


@pytest.mark.parametrize(("bias", "tied"), [(False, True), (True, False)])
def test_gpt_saved_for_transformers_gives_its_logits(tmp_path: Path, bias: bool,
                                                     tied: bool) -> None:
    """model=gpt's hf_model/ export: GPT2LMHeadModel.from_pretrained of it, the same logits."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    model = GPT(300, seq_len=16, n_layer=2, n_head=2, n_embd=32, bias=bias,
                tie_weights=tied).eval()
    with torch.no_grad():  # GPT-2's init leaves biases zero: move them, as training does
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "hf_model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model",
                                                               local_files_only=True).eval()
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert float((loaded(input_ids=ids).logits - model(ids)).abs().max()) < 1e-5
