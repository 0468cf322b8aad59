"""distributed.strategy=fsdp through the real CLI on gloo ranks, read back from the real MLflow
store: a tiny GPT trained by 1 process, DDP at world 2 and FSDP2 at worlds 2 and 3 (also
compiled, every block recomputing, and profiled: each rank's trace) takes the same steps (loss
and weights); validation with uneven shards ends (no hang) and stays exact; a job killed
mid-epoch at world 2 resumes at world 1 and at world 3, under FSDP and DDP, in one run with
every step once and the losses of a job never killed; the refusals of FSDP's combinations
before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    TINY_GPT,
    USER_PATH,
    assert_refused,
    history,
    kill_job_after_checkpoints,
    new_store,
    profiled_ops,
    run_train,
    runs_in,
)

STEPS = 8
LM = (*TINY_GPT, f"trainer.max_steps={STEPS}", "tracking.log_model=false")
LOSS_TOLERANCE = 1e-5
"""Measured differences of step losses and val/loss between the four runs: < 2e-6 (float32
sums in another order)."""
WEIGHT_TOLERANCE = 1e-5


VARIANTS = {"single": ("distributed.nproc_per_node=1",),
            # Clipping at a bound no step reaches, for train/grad_norm (DDP's to compare with).
            # Activation checkpointing of every second block (the first of the two) here, and
            # of every block under FSDP at world 3: the losses of a model that keeps them.
            "ddp2": ("distributed.nproc_per_node=2", "optim.grad_clip=1000",
                     "model.activation_checkpointing=2"),
            # FSDP with its defaults (init_on=auto): the whole model built as DDP builds it.
            "fsdp2": ("distributed.nproc_per_node=2", "distributed.strategy=fsdp"),
            "fsdp3": ("distributed.nproc_per_node=3", "distributed.strategy=fsdp",
                      "model.activation_checkpointing=blocks"),
            # torch.compile under FSDP2 with every block recomputing: each block's forward
            # compiled in place, FSDP's and the recompute's hooks outside the graphs (a
            # whole-model compile failed in backward). DDP's recomputing blocks are compiled
            # by the same helper (fsdp.compile_each); DDP's whole-model compile:
            # tests/e2e/test_precision.py. Profiled too (trainer.profile: steps 4-5), which
            # must leave its losses alone.
            "fsdp2-compiled": ("distributed.nproc_per_node=2", "distributed.strategy=fsdp",
                               "trainer.compile=true", "model.activation_checkpointing=blocks",
                               "trainer.profile.enabled=true", "trainer.profile.wait=2",
                               "trainer.profile.active=2"),
            # Micro-batches of 5 (no gradient sync but on the last) and the clipping path on
            # sharded gradients (a bound no step reaches: the reference is not clipped).
            "fsdp2-accumulate": ("distributed.nproc_per_node=2", "distributed.strategy=fsdp",
                                 "trainer.accumulate_grad_batches=3", "optim.grad_clip=1000")}


@pytest.fixture(scope="module")
def trained(small_tokens: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each variant's step losses, val/loss and final weights (model.pt)."""
    root = tmp_path_factory.mktemp("parity")
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    results: dict[str, dict] = {}
    for name, args in VARIANTS.items():
        out = root / name
        done = run_train(*LM, f"data.root={small_tokens}", *args, f"tracking.run_name={name}",
                         f"hydra.run.dir={out}", env=store, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        [run] = [r for r in runs_in(store["MLFLOW_TRACKING_URI"])
                 if r.info.run_name == name]
        uri = store["MLFLOW_TRACKING_URI"]
        results[name] = {"steps": history(uri, run.info.run_id, "train/step_loss"),
                         "grad_norm": history(uri, run.info.run_id, "train/grad_norm"),
                         "val": run.data.metrics["val/loss"],
                         "params": run.data.params, "tags": run.data.tags,
                         "weights": torch.load(out / "model.pt", weights_only=True),
                         "out": out, "uri": uri, "run_id": run.info.run_id,
                         "log": done.stderr}
    return results


def test_fsdp_trains_in_parity_with_ddp_and_one_process(trained: dict[str, dict]) -> None:
    reference = trained["single"]
    assert [s for s, _ in reference["steps"]] == list(range(1, STEPS + 1))
    for name in ("ddp2", "fsdp2", "fsdp3", "fsdp2-accumulate", "fsdp2-compiled"):
        run = trained[name]
        assert [s for s, _ in run["steps"]] == list(range(1, STEPS + 1)), name
        assert [v for _, v in run["steps"]] == pytest.approx(
            [v for _, v in reference["steps"]], abs=LOSS_TOLERANCE), name
        # Validation at world 2 and 3 ran uneven shards (filler forwards under FSDP): it ended
        # and its loss is every validation token's, as in one process.
        assert run["val"] == pytest.approx(reference["val"], abs=LOSS_TOLERANCE), name
        weights = run["weights"]
        assert weights.keys() == reference["weights"].keys()
        worst = max(float((weights[k] - reference["weights"][k]).abs().max()) for k in weights)
        assert worst < WEIGHT_TOLERANCE, (name, worst)
        # The same seed, the same initial weights: the model was built whole, as DDP's is.
        assert run["tags"].get("fsdp.init_on") == ("cpu" if "fsdp" in name else None), name
    assert "FSDP2: 2 Block blocks sharded over 3 ranks" in trained["fsdp3"]["log"]
    # Each wrote its transformers export (tests/unit/test_tokens.py: the same logits), under
    # FSDP from rank 0's plain copy.
    for name in ("single", "fsdp3"):
        config = json.loads((trained[name]["out"] / "hf_model" / "config.json").read_text())
        assert (config["model_type"], config["n_layer"], config["vocab_size"]) == ("gpt2", 2, 256)
    assert trained["ddp2"]["tags"]["activation_checkpointing"] == "1 of 2 Block blocks"
    assert trained["fsdp3"]["tags"]["activation_checkpointing"] == "2 of 2 Block blocks"
    assert trained["fsdp2-compiled"]["tags"]["activation_checkpointing"] == "2 of 2 Block blocks"
    assert "trainer.compile under FSDP2: 2 blocks' forwards compiled" in \
        trained["fsdp2-compiled"]["log"]
    assert "activation_checkpointing" not in trained["fsdp2"]["tags"]
    # trainer.profile under FSDP with compile: each rank's trace, from the run's artifacts,
    # holds the profiled steps (zero-based), FSDP's gathers and reduce-scatters and the
    # compiled graphs.
    profiled = trained["fsdp2-compiled"]
    assert profiled["tags"]["profile.steps"] == "4-5"
    ops = profiled_ops(profiled["uri"], profiled["run_id"], profiled["out"] / "downloaded")
    assert sorted(ops) == [0, 1]
    for rank, names in ops.items():
        assert {"ProfilerStep#3", "ProfilerStep#4", "FSDP::all_gather",
                "FSDP::post_backward_reduce"} <= names, rank
        assert any(n.startswith("Torch-Compiled Region") for n in names), rank
    # The norm clipping saw, at each logging step: under FSDP the whole gradient's (its shards'
    # norms combined), the same as DDP's; none logged without clipping.
    ddp_norms, fsdp_norms = trained["ddp2"]["grad_norm"], trained["fsdp2-accumulate"]["grad_norm"]
    assert [s for s, _ in ddp_norms] == list(range(1, STEPS + 1))
    assert all(v > 0 for _, v in ddp_norms)
    assert [s for s, _ in fsdp_norms] == [s for s, _ in ddp_norms]
    assert [v for _, v in fsdp_norms] == pytest.approx([v for _, v in ddp_norms], rel=1e-4)
    assert trained["single"]["grad_norm"] == []
    # The parameter count is the whole model's (from shapes), not a shard's.
    assert (trained["fsdp2"]["params"]["model.params_trainable"]
            == trained["single"]["params"]["model.params_trainable"])


def test_meta_device_init_trains_and_rank_0_outputs_are_whole(
        small_tokens: Path, store: dict[str, str], tmp_path: Path) -> None:
    """distributed.fsdp.init_on=meta: no whole model on any rank; the shards are initialised by
    the model's init_weights and the loss falls; the run says its initial weights were
    initialised shard by shard (tag fsdp.init_on=meta). What rank 0 writes alone is the
    whole model: best.pt (then the final weights: test_on=best), model.pt, the MLflow model
    (exported for the registry) that load_model reads back."""
    from train.load import load_model

    args = [a for a in LM if a != "tracking.log_model=false"]
    done = run_train(*args, f"data.root={small_tokens}", "distributed.nproc_per_node=2",
                     "distributed.strategy=fsdp", "distributed.fsdp.init_on=meta",
                     "trainer.precision=bf16-mixed",
                     "trainer.save_best=true", "trainer.test_on=best",
                     "tracking.register_model=fsdp-gpt", f"hydra.run.dir={tmp_path / 'job'}",
                     env=store, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["fsdp.init_on"] == "meta"
    steps = history(uri, run.info.run_id, "train/step_loss")
    assert steps[-1][1] < steps[0][1]
    weights = torch.load(tmp_path / "job" / "model.pt", weights_only=True)
    best = torch.load(tmp_path / "job" / "checkpoints" / "best.pt", weights_only=True)
    assert weights["wte.weight"].shape == (256, 32)
    assert all(torch.equal(weights[k], best["model"][k]) for k in weights)
    model = load_model(run.info.run_id, uri)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert "registered the model" in done.stderr


RESUMES = {"fsdp-to-1": ("fsdp", 1), "fsdp-to-3-as-ddp": ("ddp", 3),
           "ddp-to-3-as-fsdp": ("fsdp", 3),
           # Checkpoints written in the background (dcp.async_save), each completed before
           # the next: the killed job's newest whole one resumes as a synchronous one does.
           "fsdp-async-to-1": ("fsdp", 1)}


@pytest.mark.parametrize("case", list(RESUMES))
def test_a_job_killed_mid_epoch_at_world_2_resumes_at_another_world_size(
        case: str, small_tokens: Path, trained: dict[str, dict], tmp_path: Path,
        store_template: Path) -> None:
    """Killed after its third checkpoint (mid-epoch: one epoch of 19 steps), resumed on
    another number of ranks and, two of the cases, another strategy: one run, every step
    logged, the losses of the run never killed (the single-process reference)."""
    strategy, world = RESUMES[case]
    first = "ddp" if case.startswith("ddp") else "fsdp"
    store = {"MLFLOW_TRACKING_URI": new_store(tmp_path / "mlflow.db", store_template)}
    args = (*LM, f"data.root={small_tokens}", "trainer.checkpoint_interval_min=0",
            "trainer.keep_checkpoints=10")
    out = tmp_path / "job"
    background = ("distributed.fsdp.async_checkpoint=true",) if "async" in case else ()
    kill_job_after_checkpoints(out, store, 3, *args, "distributed.nproc_per_node=2",
                               f"distributed.strategy={first}", *background)
    resumed = run_train(*args, f"distributed.nproc_per_node={world}",
                        f"distributed.strategy={strategy}", *background, f"hydra.run.dir={out}",
                        env=store, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "continuing MLflow run" in resumed.stderr
    if background:  # and the job's last one was completed before it ended
        assert "written in the background" in resumed.stderr
        assert not list((out / "checkpoints").glob("*.tmp"))
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    reference = dict(trained["single"]["steps"])
    steps = history(uri, run.info.run_id, "train/step_loss")
    assert sorted({s for s, _ in steps}) == list(range(1, STEPS + 1))
    for step, value in steps:  # a step logged twice (after the checkpoint, before the kill)
        assert value == pytest.approx(reference[step], abs=LOSS_TOLERANCE), step
    assert run.data.metrics["val/loss"] == pytest.approx(trained["single"]["val"],
                                                         abs=LOSS_TOLERANCE)


@pytest.mark.parametrize(("overrides", "expected"), [
    (("trainer.precision=fp16-mixed",), "distributed.strategy=fsdp cannot be combined with "
                                        "trainer.precision=fp16-mixed"),
    (("model.weights=/nonexistent.pt", "distributed.fsdp.init_on=meta"),
     "needs distributed.fsdp.init_on=auto or cpu"),
    (("distributed.fsdp.init_on=disk",),
     "distributed.fsdp.init_on='disk'; choose auto, cpu or meta"),
])
def test_fsdp_refusals_come_before_any_rank(overrides: tuple[str, ...], expected: str,
                                            store: dict[str, str], tmp_path: Path) -> None:
    done = run_train("distributed.strategy=fsdp", "distributed.nproc_per_node=2", *overrides,
                     f"hydra.run.dir={tmp_path / 'job'}", env=store, timeout=60)
    assert_refused(done, expected, store)


def test_an_unknown_strategy_is_refused(store: dict[str, str], tmp_path: Path) -> None:
    done = run_train("distributed.strategy=zero3", f"hydra.run.dir={tmp_path / 'job'}",
                     env=store, timeout=60)
    assert_refused(done, "distributed.strategy='zero3'; choose ddp or fsdp", store)


def test_a_model_that_cannot_be_initialised_on_meta_is_named(
        small_tokens: Path, store: dict[str, str], tmp_path: Path) -> None:
    """A parameter of the model's own with no reset_parameters(): init_on=meta says which and
    what to do, in one line; the default (auto: the model fits in host memory, so it is built
    whole) trains the same model."""
    args = ("data=tokens", f"data.root={small_tokens}", "task=language_model", "model=custom",
            "data.num_workers=0", "data.seq_len=32", "data.batch_size=16",
            "task.sample_tokens=0", "tracking.log_model=false", "trainer.epochs=1",
            "model._target_=userpkg.models.ScaledBigramLM", "distributed.nproc_per_node=2",
            "distributed.strategy=fsdp", "trainer.max_steps=2")
    env = {**store, "PYTHONPATH": USER_PATH}
    done = run_train(*args, "distributed.fsdp.init_on=meta", f"hydra.run.dir={tmp_path / 'meta'}",
                     env=env, timeout=120)
    assert_refused(done, "distributed.fsdp.init_on=meta cannot initialise model "
                   "ScaledBigramLM: its module (root) (ScaledBigramLM) holds parameters", store)
    assert "or set distributed.fsdp.init_on=cpu" in done.stderr
    done = run_train(*args, f"hydra.run.dir={tmp_path / 'auto'}", env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
