"""model=hf through the real CLI on gloo ranks: a random 2-layer GPT-2 built by `transformers`
from a config trains on the tiny token set under DDP and FSDP with the same losses, its
`save_pretrained` export (a run artifact) is loaded back by `transformers` alone with the
service's logits; a small ViT trains on images with its sizes filled from the data; what
cannot work is refused in one line before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_refused, history, new_store, run_train, runs_in

pytest.importorskip("transformers", reason="model=hf needs the hf extra (make setup has it)")

GPT2 = ("data=tokens", "task=language_model", "model=hf", "+model.config.n_layer=2",
        "+model.config.n_head=2", "+model.config.n_embd=32", "data.seq_len=32",
        "data.num_workers=0", "optim=adamw", "optim.lr=3e-3", "task.sample_tokens=0",
        "trainer.log_every_n_steps=1", "trainer.epochs=1", "trainer.max_steps=8",
        "data.batch_size=30", "tracking.log_model=false")
VAL_LOSS_BELOW = 5.3
"""ln(256) = 5.55 is a uniform guess over the byte vocabulary; 8 steps take the random GPT-2 to
5.13 (measured)."""
RELOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True).eval()
ids = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[3])
assert not [m for m in sys.modules if m == "train" or m.startswith("train.")]
"""


@pytest.fixture(scope="module")
def gpt2_runs(small_tokens: Path, tmp_path_factory: pytest.TempPathFactory,
              store_template: Path) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("hf")
    store = {"MLFLOW_TRACKING_URI": new_store(root / "mlflow.db", store_template)}
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp", "fsdp")):
        out = root / name
        done = run_train(*GPT2, f"data.root={small_tokens}", "distributed.nproc_per_node=2",
                         f"distributed.strategy={strategy}", f"tracking.run_name={name}",
                         f"hydra.run.dir={out}", env=store, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        [run] = [r for r in runs_in(store["MLFLOW_TRACKING_URI"]) if r.info.run_name == name]
        runs[name] = {"out": out, "run": run, "store": store,
                      "steps": history(store["MLFLOW_TRACKING_URI"], run.info.run_id,
                                       "train/step_loss")}
    return runs


def test_a_random_gpt2_trains_alike_under_ddp_and_fsdp(gpt2_runs: dict[str, dict]) -> None:
    ddp, fsdp = gpt2_runs["ddp"], gpt2_runs["fsdp"]
    assert [s for s, _ in ddp["steps"]] == list(range(1, 9))
    assert [v for _, v in fsdp["steps"]] == pytest.approx([v for _, v in ddp["steps"]],
                                                          abs=1e-5)
    for run in (ddp["run"], fsdp["run"]):
        assert run.info.status == "FINISHED"
        assert run.data.metrics["val/loss"] < VAL_LOSS_BELOW
    # FSDP sharded the model's own blocks (its ModuleList's GPT2Block, its _no_split_modules).
    assert "2 GPT2Block blocks sharded over 2 ranks" in (fsdp["out"] / "train.log").read_text()


def test_the_export_loads_in_transformers_alone_with_the_services_logits(
        gpt2_runs: dict[str, dict], tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from train.models.hf import build

    ddp = gpt2_runs["ddp"]
    client = MlflowClient(tracking_uri=ddp["store"]["MLFLOW_TRACKING_URI"])
    exported = {Path(a.path).name for a in client.list_artifacts(ddp["run"].info.run_id,
                                                                 "hf_model")}
    assert {"config.json", "model.safetensors"} <= exported
    downloaded = Path(client.download_artifacts(ddp["run"].info.run_id, "hf_model",
                                                str(tmp_path)))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run([sys.executable, "-c", RELOAD, str(downloaded), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # The service's model: built as the job built it, with its final weights (model.pt).
    ours = build(config={"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32},
                 vocab_size=256)
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
