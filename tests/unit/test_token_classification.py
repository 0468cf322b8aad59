"""task=token_classification's sums and metrics, and the alignment of a column of words with
its tags to a tokenizer's pieces (train/data/tokenize.py TextEncoder.words). A whole run:
tests/e2e/test_hf.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train.tasks.base import summed
from train.tasks.token_classification import TokenClassification

pytest.importorskip("tokenizers", reason="data.tokenizer needs the hf extra (make setup has it)")


def test_a_words_first_piece_carries_its_tag_and_the_rest_count_nowhere(
        bpe_tokens: Path) -> None:
    from train.data.tokenize import TextEncoder

    encoder = TextEncoder(str(bpe_tokens), 20, by_words=True)
    words = [["render", "xylophonequartz", "a"], ["object"]]
    ids, labels = encoder.words(words, [[1, 2, 0], [2]])
    assert ids.shape == labels.shape == (2, 20)
    pieces = [sum(i != encoder.pad_id for i in encoder._loaded().encode(w).ids)
              for w in words[0]]
    assert pieces[1] > 1  # a word the BPE splits
    expected = [1] + [-100] * (pieces[0] - 1) + [2] + [-100] * (pieces[1] - 1) + [0]
    expected += [-100] * (20 - len(expected))
    assert labels[0].tolist() == expected
    assert labels[1, 0] == 2 and (labels[1, 1:] == -100).all()
    assert (ids[1, 1:] == encoder.pad_id).all()


def test_accuracy_and_macro_f1_come_from_the_tokens_that_count() -> None:
    task = TokenClassification()
    task.setup(summed(torch.nn.CrossEntropyLoss(ignore_index=-100)), 3, ["O", "A", "B"])
    target = torch.tensor([[0, 1, -100, 2], [1, 1, 0, -100]])
    predicted = torch.tensor([[0, 1, 2, 1], [1, 0, 0, 0]])  # the -100 positions: anything
    logits = torch.nn.functional.one_hot(predicted, 3).float() * 10  # (batch, tokens, classes)
    loss, sums = task.step(logits, target, detailed=False)
    assert int(sums["items"]) == 6 and sums["samples"] == 2
    confusion = sums["confusion"]
    assert confusion.tolist() == [[2, 0, 0], [1, 2, 0], [0, 1, 0]]  # rows: true O, A, B
    metrics = task.finalize({"loss": float(loss), "items": 6, "confusion": confusion.tolist()})
    assert metrics["accuracy"] == pytest.approx(4 / 6)
    f1 = {"O": 2 * (2 / 3 * 1) / (2 / 3 + 1), "A": 2 * (2 / 3 * 2 / 3) / (4 / 3), "B": 0.0}
    assert metrics["macro_f1"] == pytest.approx(sum(f1.values()) / 3)
    assert task.output_problem(logits, target, None) is None
    assert "needs (batch, tokens, num_classes) = (2, 4, 3)" in task.output_problem(
        logits.transpose(1, 2), target, None)
    assert task.target_problem(torch.tensor([1, 2])) is None
    assert "a sequence of integer class indices" in task.target_problem(torch.tensor(1.5))
