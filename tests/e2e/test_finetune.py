"""Fine-tuning end to end: a first run's model.pt fine-tuned with frozen layers on two ranks
and resumed, read back from a real MLflow store; and the CLI's refusals of weights that
cannot be used (exit 2, one line, no run). In process: tests/unit/test_finetune.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import composed, history, new_store, run_train, runs_in
from tests.unit.test_finetune import mlp
from tests.unit.test_job import SMALL
from train.app import run


@pytest.mark.usefixtures("no_launcher_env")
def test_a_runs_model_fine_tuned_with_frozen_layers(tmp_path: Path, store_template: Path) -> None:
    """Run 2 (two ranks) starts from run 1's model.pt with the first layer frozen: that layer
    ends equal to the file, the rest trained on. Run 2 again, its weights file gone: the
    checkpoint is resumed, model.weights not read."""
    uri = new_store(tmp_path / "mlflow.db", store_template)
    common = (*SMALL, f"tracking.uri={uri}", "tracking.log_model=false")
    run(composed(*common, "trainer.epochs=1"), str(tmp_path / "first"), "t")
    source = tmp_path / "first" / "model.pt"
    tuned = (*common, f"model.weights={source}", "model.freeze=[1]",
             "optim.param_groups=[{prefix:6,lr_scale:0.1}]", "tracking.run_name=tuned")
    # On 2 ranks: DDP neither syncs nor waits for the frozen parameters.
    run(composed(*tuned, "trainer.epochs=1", "distributed.nproc_per_node=2"),
        str(tmp_path / "second"), "t")
    start, end = (torch.load(p, weights_only=True)
                  for p in (source, tmp_path / "second" / "model.pt"))
    for key in start:
        assert torch.equal(start[key], end[key]) == key.startswith("1."), key
    [second] = [r for r in runs_in(uri) if r.info.run_name == "tuned"]
    assert second.data.tags["weights_source"] == str(source)
    assert second.data.params["model.weights"] == str(source)
    assert second.data.params["model.params_frozen"] == str(192 * 16 + 16)

    source.unlink()
    run(composed(*tuned, "trainer.epochs=2"), str(tmp_path / "second"), "t")
    resumed = torch.load(tmp_path / "second" / "model.pt", weights_only=True)
    assert torch.equal(resumed["1.weight"], start["1.weight"])
    assert not torch.equal(resumed["3.weight"], end["3.weight"])
    assert len(runs_in(uri)) == 2
    lrs = {key: history(uri, second.info.run_id, key) for key in ("lr", "lr/6")}
    assert [step for step, _ in lrs["lr/6"]] == [1, 2]
    assert [v for _, v in lrs["lr/6"]] == pytest.approx([0.1 * v for _, v in lrs["lr"]])


@pytest.mark.parametrize("case", ["another_model", "not_cached"])
def test_cli_refuses_weights_that_cannot_be_used(case: str, store: dict[str, str],
                                                 tmp_path: Path) -> None:
    torch.save(mlp(width=256).state_dict(), tmp_path / "mlp.pt")
    overrides, expected = {
        "another_model": ((f"model.weights={tmp_path / 'mlp.pt'}",),
                          "does not fit the model: "),
        "not_cached": (("model=torchvision", "model.weights=DEFAULT"),
                       "get_weight('ResNet18_Weights.IMAGENET1K_V1').get_state_dict"),
    }[case]
    out = run_train(*overrides, "data=synthetic", "data.image_size=8", "trainer.epochs=1",
                    f"hydra.run.dir={tmp_path / 'job'}",
                    env={**store, "TORCH_HOME": str(tmp_path / "empty")}, timeout=120)
    assert out.returncode == 2, out.stderr
    [line] = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert expected in line, out.stderr
    assert "Traceback" not in out.stderr and "[rank" not in out.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []
