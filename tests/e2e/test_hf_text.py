"""model=hf on texts of `datasets` directories through the real CLI on gloo ranks: a random
BERT classifier on sentences tokenized in the DataLoader's workers, and the same texts by their
Hub name from the local datasets cache, tokenized once per node (data.tokenize=map) with the
same losses; a saved classifier fine-tuned from its directory with its weights and tokenizer;
a BERT token classifier tagging words. GPT-2, ViT and the refusals: tests/e2e/test_hf.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import (
    HUB_NAME,
    SENTENCES,
    VOCAB,
    assert_refused,
    history,
    run_train,
    runs_in,
)

pytest.importorskip("transformers", reason="model=hf needs the hf extra (make setup has it)")


BERT = ("data=arrow", "data.max_length=16", "model=hf", "model.auto_class=sequence_classification",
        "model.config.model_type=bert", "+model.config.hidden_size=32",
        "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=2",
        "+model.config.intermediate_size=64", "optim=adamw", "optim.lr=3e-3", "trainer.epochs=6",
        "data.batch_size=32", "data.num_workers=1", "data.shuffle=global",
        "distributed.nproc_per_node=2", "tracking.log_model=false")


def test_a_small_bert_classifies_texts_tokenized_in_workers_or_once_per_node(
        sentences: Path, hub_cache: Path, bpe_tokens: Path, store: dict[str, str],
        tmp_path: Path) -> None:
    """Texts tokenized in the DataLoader's workers with the BPE (padded with its <pad>, masked
    out of attention), a random 2-layer BERT classifier at 2 ranks: every validation text once,
    accuracy far above chance; vocab_size, pad_token_id and num_labels filled from the data.
    Then the same texts by their Hub name, from the local datasets cache, with
    data.tokenize=map: the set tokenized once (not once per rank) into data.tokenized_to, the
    same ids, so the same losses at every step."""
    uri, cache = store["MLFLOW_TRACKING_URI"], tmp_path / "tokenized"
    ran = {}
    for mode, root in (("workers", sentences), ("map", HUB_NAME)):
        done = run_train(*BERT, f"data.root={root}", f"data.tokenizer={bpe_tokens}",
                         f"data.tokenize={mode}", f"data.tokenized_to={cache}",
                         f"hydra.run.dir={tmp_path / mode}", timeout=300,
                         env={**store, "HF_DATASETS_CACHE": str(hub_cache)})
        assert done.returncode == 0, done.stderr[-3000:]
        [ran[mode]] = [r for r in runs_in(uri) if r.info.run_id not in
                       {x.info.run_id for x in ran.values()}]
    run = ran["workers"]
    assert run.data.metrics["val/samples"] == SENTENCES - SENTENCES * 4 // 5
    assert run.data.metrics["val/accuracy"] > 0.8, run.data.metrics  # chance: 0.5
    # The model's FLOPs counted on token ids, through the padding mask: train/tflops_per_sec.
    assert run.data.metrics["train/tflops_per_sec"] > 0, run.data.metrics
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path / "workers" / "hf_model", local_files_only=True)
    assert (config.vocab_size, config.pad_token_id, config.num_labels) == (VOCAB, 0, 2)
    assert config.id2label == {0: "animals", 1: "numbers"}  # the ClassLabel's names
    # map: one tokenizing pass for the two ranks, and batches of the same ids in the same order
    [line] = (cache / "tokenize.log").read_text().splitlines()
    assert f"rows={SENTENCES}" in line and line.startswith("0123abcd-")  # the cache's copy
    assert ran["map"].data.metrics["val/samples"] == run.data.metrics["val/samples"]
    for key in ("train/loss", "val/loss", "val/accuracy"):
        ours, theirs = (history(uri, ran[m].info.run_id, key) for m in ("map", "workers"))
        assert [s for s, _ in ours] == [s for s, _ in theirs] and ours
        assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], abs=1e-6), key


def test_a_saved_model_fine_tunes_from_its_directory_with_its_weights_and_tokenizer(
        sentences: Path, bpe_tokens: Path, store: dict[str, str], tmp_path: Path) -> None:
    """model.path= the export of a trained classifier (its weights, config and tokenizer):
    with a learning rate too small to move it, the first epoch's val/loss is the trained
    run's last - every weight loaded, the embeddings not made afresh for the data's
    vocabulary. A tokenizer larger than the saved model's vocabulary is refused at pre-flight."""
    uri = store["MLFLOW_TRACKING_URI"]
    trained = run_train(*BERT, f"data.root={sentences}", f"data.tokenizer={bpe_tokens}",
                        "trainer.epochs=2", f"hydra.run.dir={tmp_path / 'trained'}", env=store,
                        timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    [first] = runs_in(uri)
    saved = tmp_path / "trained" / "hf_model"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    assert tokenizer.pad_token == "<pad>"  # padding=True pads as the run did
    assert tokenizer(["cat one"], padding="max_length", max_length=16)["input_ids"][0][-1] == 0
    tuned = run_train(*BERT, f"data.root={sentences}", f"data.tokenizer={saved}",
                      f"model.path={saved}", "trainer.epochs=1", "optim.lr=1e-12",
                      "model.config.model_type=null", f"hydra.run.dir={tmp_path / 'tuned'}",
                      env=store, timeout=300)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    [second] = [r for r in runs_in(uri) if r.info.run_id != first.info.run_id]
    assert second.data.metrics["val/loss"] == pytest.approx(first.data.metrics["val/loss"],
                                                            abs=1e-5)
    import json

    bigger = tmp_path / "tokenizer.json"
    spec = json.loads((saved / "tokenizer.json").read_text())
    spec["model"]["vocab"].update({f"extra{i}": VOCAB + i for i in range(8)})
    bigger.write_text(json.dumps(spec))
    refused = run_train(*BERT, f"data.root={sentences}", f"data.tokenizer={bigger}",
                        f"model.path={saved}", f"hydra.run.dir={tmp_path / 'refused'}",
                        env=store, timeout=120)
    assert refused.returncode == 2, refused.stderr[-3000:]
    [line] = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert f"the model's vocabulary ({VOCAB} tokens) is smaller than the data's ({VOCAB + 8}): " \
        "tokenize the data with the model's own tokenizer" in line
    assert len(runs_in(uri)) == 2  # no run for the refused job


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `datasets` directory of sentences split into words with a tag per word (conll's
    layout: `tokens`, `ner_tags` a list of ClassLabel): animals ANIMAL, numbers NUMBER, the
    rest O; 160 training and 40 validation sentences."""
    import random

    import datasets

    rng = random.Random(1)
    kinds = {1: ["cat", "dog", "horse", "bird", "fish"], 2: ["one", "two", "seven", "ten"],
             0: ["the", "a", "and", "of", "saw", "with", "near"]}
    rows: dict[str, list] = {"tokens": [], "ner_tags": []}
    for _ in range(200):
        tags = [rng.choice((0, 0, 1, 2)) for _ in range(rng.randint(3, 9))]
        rows["tokens"].append([rng.choice(kinds[t]) for t in tags])
        rows["ner_tags"].append(tags)
    features = datasets.Features({
        "tokens": datasets.Sequence(datasets.Value("string")),
        "ner_tags": datasets.Sequence(datasets.ClassLabel(names=["O", "ANIMAL", "NUMBER"]))})
    whole = datasets.Dataset.from_dict(rows, features=features)
    out = tmp_path_factory.mktemp("tagged") / "set"
    datasets.DatasetDict({"train": whole.select(range(160)),
                          "validation": whole.select(range(160, 200))}).save_to_disk(out)
    return out


def test_a_small_bert_tags_the_words_of_a_datasets_directory(
        tagged: Path, bpe_tokens: Path, store: dict[str, str], tmp_path: Path) -> None:
    """task=token_classification with model.auto_class=token_classification at 2 ranks: each
    word's first piece carries its tag (the others and the padding -100), a random 1-layer
    BERT learns the tags far above always saying O; num_labels 3 filled from the ClassLabel."""
    import datasets

    done = run_train("data=arrow", f"data.root={tagged}", f"data.tokenizer={bpe_tokens}",
                     "data.max_length=24", "task=token_classification", "model=hf",
                     "model.auto_class=token_classification", "model.config.model_type=bert",
                     "+model.config.hidden_size=32", "+model.config.num_hidden_layers=1",
                     "+model.config.num_attention_heads=2", "+model.config.intermediate_size=64",
                     "optim=adamw", "optim.lr=5e-3", "trainer.epochs=6", "data.batch_size=32",
                     "data.num_workers=1", "distributed.nproc_per_node=2",
                     "tracking.log_model=false", f"hydra.run.dir={tmp_path / 'job'}", env=store,
                     timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    metrics = run.data.metrics
    val_tags = [t for row in datasets.load_from_disk(str(tagged / "validation"))["ner_tags"]
                for t in row]
    always_o = val_tags.count(0) / len(val_tags)  # ~0.5: the baseline to beat
    assert metrics["val/samples"] == 40
    assert metrics["val/accuracy"] > always_o + 0.3, (metrics, always_o)
    assert metrics["val/macro_f1"] > 0.8, metrics
    config = json.loads((tmp_path / "job" / "hf_model" / "config.json").read_text())
    assert config["id2label"] == {"0": "O", "1": "ANIMAL", "2": "NUMBER"}  # the ClassLabel's


def test_a_text_column_without_a_tokenizer_is_refused(sentences: Path, store: dict[str, str],
                                                      tmp_path: Path) -> None:
    done = run_train("data=arrow", f"data.root={sentences}", "model=hf",
                     "model.auto_class=sequence_classification", "model.config.model_type=bert",
                     f"hydra.run.dir={tmp_path / 'job'}", env=store, timeout=120)
    assert_refused(done, "data.input_column='text' of", store)
    assert "holds text: give data.tokenizer=" in done.stderr
