"""model=hf through the real CLI on gloo ranks: a random 2-layer GPT-2 built by `transformers`
from a config trains on pydoc's source tokenized by a byte-level BPE that prepare-text trained
on it, under DDP and FSDP with the same losses; it samples text decoded with that tokenizer;
its `save_pretrained` export (a run artifact, tokenizer included) is loaded back by
`transformers` alone with the service's logits and the same token ids; killed under FSDP it
resumes with the same losses; in bf16, compiled, its model registered; a small ViT trains on
images with its sizes filled from the data; what cannot work is refused in one line before
any rank starts. Texts of datasets directories: tests/e2e/test_hf_text.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (
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
    """model=hf under FSDP with its GPT2Blocks recomputed in backward, killed (SIGKILL,
    launcher and ranks) after its 4th checkpoint, resumed into the same run: its 8 step losses
    and its val/loss are the uninterrupted DDP run's (float32 sums in another order: 1e-5) -
    each rank's RNG restored, so GPT-2's dropout draws the same masks (the recompute too).
    (At another world size the ranks' dropout streams differ, and so do the losses, by ~3e-3
    here: a model without dropout resumes at any world size alike, tests/e2e/test_fsdp.py.)"""
    store = {"MLFLOW_TRACKING_URI": new_store(tmp_path / "mlflow.db", store_template)}
    args = (*GPT2, f"data.root={bpe_tokens}", "distributed.strategy=fsdp",
            "model.activation_checkpointing=blocks",
            "trainer.checkpoint_interval_min=0", "trainer.keep_checkpoints=20")
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
    assert run.data.tags["activation_checkpointing"] == "2 of 2 GPT2Block blocks"


def test_a_gpt2_trains_in_bf16_compiled_and_registers_its_model(
        gpt2_runs: dict[str, dict], bpe_tokens: Path, store: dict[str, str],
        tmp_path: Path) -> None:
    """model=hf with trainer.precision=bf16-mixed and trainer.compile=true at 1 rank, its model
    registered (torch.export traces it at pre-flight and after training): the same losses as
    the float32 DDP run to bf16's precision, and version 1 of the registered name is this
    run's."""
    done = run_train(*GPT2, f"data.root={bpe_tokens}", "trainer.precision=bf16-mixed",
                     "trainer.compile=true", "tracking.log_model=true",
                     "tracking.register_model=tiny-gpt2",
                     f"hydra.run.dir={tmp_path / 'job'}", env=store, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    steps = history(uri, run.info.run_id, "train/step_loss")
    assert [s for s, _ in steps] == list(range(1, 9))
    assert [v for _, v in steps] == pytest.approx([v for _, v in gpt2_runs["ddp"]["steps"]],
                                                  abs=0.05)
    assert "trainer.compile=true" not in done.stdout + done.stderr  # not suggested: it is on
    from mlflow import MlflowClient

    [version] = MlflowClient(tracking_uri=uri).search_model_versions("name='tiny-gpt2'")
    assert int(version.version) == 1 and version.run_id == run.info.run_id


def test_a_sweep_over_the_hf_config_makes_a_parent_and_its_children(
        bpe_tokens: Path, store: dict[str, str], tmp_path: Path) -> None:
    """`-m` over a key of model.config (the layers of the random GPT-2): one child run per
    value under the sweep's parent, each with its value among its params, the parent naming
    the child of the lowest val/loss."""
    args = tuple(a for a in GPT2 if not a.startswith("+model.config.n_layer"))
    done = run_train("-m", *args, f"data.root={bpe_tokens}", "+model.config.n_layer=1,2",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", env=store, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = runs_in(store["MLFLOW_TRACKING_URI"])
    [parent] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(c.data.params["model.config.n_layer"] for c in children) == ["1", "2"]
    assert all(c.info.status == "FINISHED" for c in children + [parent])
    best = min(children, key=lambda c: c.data.metrics["val/loss"])
    assert parent.data.tags["best_run_id"] == best.info.run_id


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


@pytest.mark.parametrize(("overrides", "expected"), [
    (("model.auto_class=nonsense",), "model.auto_class='nonsense': choose causal_lm"),
    (("model.path=/nonexistent/model",), "model.path=/nonexistent/model: no such model"),
    (("+model.config.vocab_size=100",), "the model's vocabulary (100 tokens) is smaller than "
                                        "the data's (256)"),
    (("missing",), "model=hf needs the transformers package, not installed here: pip install"),
    (("model.activation_checkpointing=blocks", "trainer.compile=true"),
     "model=hf with model.activation_checkpointing and trainer.compile=true: torch.compile"),
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
