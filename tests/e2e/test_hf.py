"""model=hf through the real CLI on gloo ranks: a random 2-layer GPT-2 built by `transformers`
from a config trains on pydoc's source tokenized by a byte-level BPE that prepare-text trained
on it, under DDP and FSDP with the same losses; it samples text decoded with that tokenizer;
its `save_pretrained` export (a run artifact, tokenizer included) is loaded back by
`transformers` alone with the service's logits and the same token ids; a small ViT trains on
images with its sizes filled from the data; what cannot work is refused in one line before
any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    HUB_NAME,
    SENTENCES,
    VOCAB,
    assert_refused,
    history,
    kill_job_after_checkpoints,
    new_store,
    run_train,
    runs_in,
)

pytest.importorskip("transformers", reason="model=hf needs the hf extra (make setup has it)")

GPT2 = ("data=tokens", "task=language_model", "model=hf", "+model.config.n_layer=2",
        "+model.config.n_head=2", "+model.config.n_embd=32", "data.seq_len=32",
        "data.num_workers=0", "optim=adamw", "optim.lr=1e-2", "task.sample_tokens=0",
        "trainer.log_every_n_steps=1", "trainer.epochs=1", "trainer.max_steps=8",
        "data.batch_size=30", "tracking.log_model=false")
VAL_LOSS_BELOW = 6.15
"""ln(512) = 6.24 is a uniform guess over the BPE's vocabulary; 8 steps take the random GPT-2 to
6.06 (measured)."""
TEXT = "def render(self, object, name=None):\n    return self.document(object)\n"
RELOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True).eval()
ids = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[3])
text = open(sys.argv[4]).read()
print(AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)(text)["input_ids"])
assert not [m for m in sys.modules if m == "train" or m.startswith("train.")]
"""


@pytest.fixture(scope="module")
def gpt2_runs(bpe_tokens: Path, tmp_path_factory: pytest.TempPathFactory,
              store_template: Path) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("hf")
    store = {"MLFLOW_TRACKING_URI": new_store(root / "mlflow.db", store_template)}
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp", "fsdp")):
        out = root / name
        sampling = ("task.sample_tokens=16",) if name == "ddp" else ()
        done = run_train(*GPT2, f"data.root={bpe_tokens}", "distributed.nproc_per_node=2",
                         f"distributed.strategy={strategy}", f"tracking.run_name={name}",
                         *sampling,
                         f"hydra.run.dir={out}", env=store, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        [run] = [r for r in runs_in(store["MLFLOW_TRACKING_URI"]) if r.info.run_name == name]
        runs[name] = {"out": out, "run": run, "store": store,
                      "steps": history(store["MLFLOW_TRACKING_URI"], run.info.run_id,
                                       "train/step_loss")}
    return runs


def test_a_random_gpt2_trains_alike_under_ddp_and_fsdp_on_a_trained_bpe(
        gpt2_runs: dict[str, dict], bpe_tokens: Path) -> None:
    ddp, fsdp = gpt2_runs["ddp"], gpt2_runs["fsdp"]
    tokenizer = str((bpe_tokens / "tokenizer.json").resolve())
    assert ddp["run"].data.params["data.tokenized_with"] == tokenizer
    # Its samples are decoded with that tokenizer: the text re-encodes to ids of its vocabulary.
    from train.data.tokenize import FileTokenizer

    samples = (ddp["out"] / "samples.txt").read_text()
    assert samples.count("prompt:") >= 1
    assert max(FileTokenizer(bpe_tokens).encode(samples.encode())) < VOCAB
    assert [s for s, _ in ddp["steps"]] == list(range(1, 9))
    assert [v for _, v in fsdp["steps"]] == pytest.approx([v for _, v in ddp["steps"]],
                                                          abs=1e-5)
    for run in (ddp["run"], fsdp["run"]):
        assert run.info.status == "FINISHED"
        assert run.data.metrics["val/loss"] < VAL_LOSS_BELOW
    # FSDP sharded the model's own blocks (its ModuleList's GPT2Block, its _no_split_modules).
    assert "2 GPT2Block blocks sharded over 2 ranks" in (fsdp["out"] / "train.log").read_text()


def test_a_gpt2_killed_under_fsdp_resumes_with_the_ddp_losses(
        gpt2_runs: dict[str, dict], bpe_tokens: Path, tmp_path: Path,
        store_template: Path) -> None:
    """model=hf under FSDP, killed (SIGKILL, launcher and ranks) after its 4th checkpoint,
    resumed into the same run: its 8 step losses and its val/loss are the uninterrupted DDP
    run's (float32 sums in another order: 1e-5) - each rank's RNG restored, so GPT-2's dropout
    draws the same masks. (At another world size the ranks' dropout streams differ, and so do
    the losses, by ~3e-3 here: a model without dropout resumes at any world size alike,
    tests/e2e/test_fsdp.py.)"""
    store = {"MLFLOW_TRACKING_URI": new_store(tmp_path / "mlflow.db", store_template)}
    args = (*GPT2, f"data.root={bpe_tokens}", "distributed.strategy=fsdp",
            "trainer.checkpoint_interval_min=0.0001", "trainer.keep_checkpoints=20")
    out = tmp_path / "job"
    kill_job_after_checkpoints(out, store, 4, *args, "distributed.nproc_per_node=2")
    resumed = run_train(*args, "distributed.nproc_per_node=2", f"hydra.run.dir={out}",
                        env=store, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)  # one run across the restart
    steps, reference = history(uri, run.info.run_id, "train/step_loss"), gpt2_runs["ddp"]
    assert [s for s, _ in steps] == list(range(1, 9))
    assert [v for _, v in steps] == pytest.approx([v for _, v in reference["steps"]], abs=1e-5)
    assert run.data.metrics["val/loss"] == pytest.approx(
        reference["run"].data.metrics["val/loss"], abs=1e-5)


def test_the_export_loads_in_transformers_alone_with_the_services_logits_and_tokens(
        gpt2_runs: dict[str, dict], bpe_tokens: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from train.models.hf import build

    ddp = gpt2_runs["ddp"]
    client = MlflowClient(tracking_uri=ddp["store"]["MLFLOW_TRACKING_URI"])
    exported = {Path(a.path).name for a in client.list_artifacts(ddp["run"].info.run_id,
                                                                 "hf_model")}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= exported
    downloaded = Path(client.download_artifacts(ddp["run"].info.run_id, "hf_model",
                                                str(tmp_path)))
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "text.txt").write_text(TEXT)
    done = subprocess.run([sys.executable, "-c", RELOAD, str(downloaded), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt"), str(tmp_path / "text.txt")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    from train.data.tokenize import FileTokenizer

    expected_ids = FileTokenizer(bpe_tokens).encode(TEXT.encode())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected_ids
    assert len(expected_ids) < len(TEXT) / 1.5  # merges: fewer tokens than bytes
    # The service's model: built as the job built it, with its final weights (model.pt).
    ours = build(config={"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32},
                 vocab_size=VOCAB)
    ours.load_state_dict(torch.load(ddp["out"] / "model.pt", weights_only=True))
    with torch.no_grad():
        expected = ours.eval()(ids)
    assert float((torch.load(tmp_path / "logits.pt") - expected).abs().max()) < 1e-5


def test_a_small_vit_trains_on_images_with_its_sizes_from_the_data(
        store: dict[str, str], tmp_path: Path) -> None:
    done = run_train("data=synthetic", "data.num_samples=128", "data.image_size=16",
                     "model=hf", "model.auto_class=image_classification",
                     "model.config.model_type=vit", "+model.config.patch_size=4",
                     "+model.config.hidden_size=32", "+model.config.num_hidden_layers=2",
                     "+model.config.num_attention_heads=2", "+model.config.intermediate_size=64",
                     "trainer.epochs=1", "data.batch_size=32", "data.num_workers=0",
                     "distributed.nproc_per_node=2", "tracking.log_model=false",
                     f"hydra.run.dir={tmp_path / 'job'}", env=store, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED" and "val/accuracy" in run.data.metrics
    config = json.loads((tmp_path / "job" / "hf_model" / "config.json").read_text())
    assert (config["image_size"], config["num_channels"], len(config["id2label"])) == (16, 3, 10)


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
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path / "workers" / "hf_model", local_files_only=True)
    assert (config.vocab_size, config.pad_token_id, config.num_labels) == (VOCAB, 0, 2)
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
    assert len(config["id2label"]) == 3  # num_labels, filled from the ClassLabel


def test_a_text_column_without_a_tokenizer_is_refused(sentences: Path, store: dict[str, str],
                                                      tmp_path: Path) -> None:
    done = run_train("data=arrow", f"data.root={sentences}", "model=hf",
                     "model.auto_class=sequence_classification", "model.config.model_type=bert",
                     f"hydra.run.dir={tmp_path / 'job'}", env=store, timeout=120)
    assert_refused(done, "data.input_column='text' of", store)
    assert "holds text: give data.tokenizer=" in done.stderr


@pytest.mark.parametrize(("overrides", "expected"), [
    (("model.auto_class=nonsense",), "model.auto_class='nonsense': choose causal_lm"),
    (("model.path=/nonexistent/model",), "model.path=/nonexistent/model: no such model"),
    (("+model.config.vocab_size=100",), "the model's vocabulary (100 tokens) is smaller than "
                                        "the data's (256)"),
    (("missing",), "model=hf needs the transformers package, not installed here: pip install"),
])
def test_what_cannot_work_is_refused_before_any_rank(
        overrides: tuple[str, ...], expected: str, small_tokens: Path, store: dict[str, str],
        tmp_path: Path) -> None:
    env = dict(store)
    if overrides == ("missing",):  # a Python where `import transformers` fails
        fake = tmp_path / "site" / "transformers"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("raise ImportError('No module named transformers')\n")
        env["PYTHONPATH"] = str(fake.parent)
        overrides = ()
    done = run_train(*GPT2, f"data.root={small_tokens}", *overrides,
                     f"hydra.run.dir={tmp_path / 'job'}", env=env, timeout=120)
    assert_refused(done, expected, store)
    assert not (tmp_path / "job" / "checkpoints").exists()
