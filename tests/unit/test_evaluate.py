"""`python -m train eval`'s parts in process: the eval settings' refusals, which weights a run's
files give for `eval.weights` (real files written here), the run checks, and the evaluating
job's primary config composed by Hydra as the command writes it (its data swapped by
`data=<option>`). The command's end-to-end behaviour: tests/e2e/test_evaluate.py."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, typed
from train.config.evaluate import EvalConfig
from train.config.schema import register_schema
from train.errors import ConfigError
from train.launch import evaluate
from train.launch.preflight import validate
from train.tracking.recorded import RecordedRun


@cache
def _recorded_config() -> str:
    """A digits run's config.yaml (composed once: each composition costs ~0.3 s)."""
    from omegaconf import OmegaConf

    from tests.conftest import composed

    return OmegaConf.to_yaml(composed("data=digits", "data.batch_size=32"))


def _run(out: Path, final: str = "last", status: str = "FINISHED") -> RecordedRun:
    params = {"data.input_shape": "1x8x8", "model.outputs": "10"}
    tags = {"output_dir": str(out), "final_weights": final}
    return RecordedRun("a" * 32, status, tags, params, yaml.safe_load(_recorded_config()))


@pytest.mark.parametrize(("settings", "expected"), [
    (EvalConfig(split="train"), "eval.split=train must be one of test, val"),
    (EvalConfig(name="a b"), "eval.name='a b' must be"),
    (EvalConfig(run_id="x"), "set by `python -m train eval <run_id>`"),
])
def test_eval_settings_are_refused_in_one_line(settings: EvalConfig, expected: str) -> None:
    assert expected in str(settings.problem())
    cfg = typed()
    cfg.eval = settings
    with pytest.raises(ConfigError, match="Refusing to start"):
        validate(cfg, 1)


def test_data_of_another_shape_or_classes_is_named_with_both_shapes() -> None:
    settings = EvalConfig(run_id="r1", checkpoint="/w", trained_shape="1x8x8", trained_outputs=10)
    assert settings.data_problem("digits", (1, 8, 8), 10) is None
    line = settings.data_problem("cifar10", (3, 32, 32), 10)
    assert line is not None and "gives inputs 3x32x32 and 10 outputs" in line
    assert "trained on 1x8x8 and 10" in line
    assert settings.data_problem("custom", (1, 8, 8), 3) is not None
    assert EvalConfig().data_problem("cifar10", (3, 32, 32), 10) is None  # not evaluating


def test_an_evaluation_splits_any_batch_over_the_ranks() -> None:
    cfg = typed("data.batch_size=64")
    cfg.eval = EvalConfig(run_id="r", checkpoint="/w")
    validate(cfg, 3)  # 64 over 3 ranks: fine for evaluating (each rank's batch chunks its shard)
    with pytest.raises(ConfigError, match="gives 3 ranks no sample each"):
        cfg.data.batch_size = 2
        validate(cfg, 3)


def test_which_weights_each_word_finds_in_the_runs_output_directory(tmp_path: Path) -> None:
    out = tmp_path / "job"
    (out / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="left no final weights or checkpoint"):
        evaluate.find_weights(_run(out), "last")
    for step in (23, 46, 9):
        (out / "checkpoints" / f"step-{step:09d}.pt").write_bytes(b"x")
    assert Path(evaluate.find_weights(_run(out), "last")).name == "step-000000046.pt"
    (out / "model.pt").write_bytes(b"x")
    final = str((out / "model.pt").resolve())
    assert evaluate.find_weights(_run(out), "last") == final
    assert Path(evaluate.find_weights(_run(out, final="best"), "last")).name == "step-000000046.pt"
    assert evaluate.find_weights(_run(out, final="best"), "best") == final
    with pytest.raises(ConfigError, match="trainer.save_best=true keeps them"):
        evaluate.find_weights(_run(out), "best")
    (out / "checkpoints" / "best.pt").write_bytes(b"x")
    assert Path(evaluate.find_weights(_run(out), "best")).name == "best.pt"
    sharded = out / "checkpoints" / "step-000000050.dcp"
    sharded.mkdir()
    assert evaluate.find_weights(_run(out), str(sharded)) == str(sharded.resolve())
    with pytest.raises(ConfigError, match="no such file or directory"):
        evaluate.find_weights(_run(out), str(out / "nope.pt"))


@pytest.mark.parametrize(("purpose", "overrides", "expected"), [
    ("eval", [], "run aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa's data (data=digits) has no test split: use "
                 "its validation split (eval.split=val)"),
    ("predict", ["predict.out=x.parquet"], "no test split: use its validation split "
                                           "(predict.split=val)"),
    ("predict", ["predict.split=val", "eval.weights=best"],
     "eval.weights=best: eval.* is `python -m train eval`'s; `predict` takes predict.weights."),
    ("eval", ["eval.split=val", "predict.split=test"], "`eval` takes eval.split."),
    ("eval", ["eval.split=val", "model=mlp"],
     f"eval rebuilds run {'a' * 32}'s own model from its config"),
    ("predict", ["predict.split=val", "+task=regression"], "another task needs a run trained"),
    ("predict", ["predict.prompts=['a']"], "predict.prompts needs a language model's run"),
    ("predict", ["predict.prompts=[]"], "predict.prompts=[] holds no prompt"),
])
def test_what_eval_and_predict_cannot_take_is_refused_before_anything_starts(
        tmp_path: Path, purpose: str, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        evaluate.check_overrides(purpose, _run(tmp_path), overrides)
    assert expected in str(refused.value)


def test_the_test_split_is_checked_only_where_the_data_stays_the_runs_own(
        tmp_path: Path) -> None:
    run = _run(tmp_path)
    for fine in (["eval.split=val"], ["data=cifar10"], ["data.test._target_=pkg.Test"],
                 ["+data.test.length=9"]):
        evaluate.check_overrides("eval", run, fine)
    run.params["data.vocab_size"] = "256"  # a language model's run
    evaluate.check_overrides("predict", run, ["predict.prompts=['a']"])  # no split read
    run.params["data.num_test"] = "101"  # a run whose data had a test split
    evaluate.check_overrides("eval", run, [])


@pytest.mark.parametrize(("status", "expected"), [
    ("RUNNING", "is still RUNNING"), ("FAILED", "ended FAILED"), ("KILLED", "ended KILLED")])
def test_only_a_finished_run_is_evaluated(tmp_path: Path, status: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        evaluate.check_run(_run(tmp_path, status=status))
    assert evaluate.check_run(_run(tmp_path)) == ("1x8x8", 10)
    bare = _run(tmp_path)
    del bare.tags["final_weights"]
    with pytest.raises(ConfigError, match="has no trained model"):
        evaluate.check_run(bare)


def _compose_eval(tmp_path: Path, overrides: list[str]):
    """The evaluating job's config as Hydra composes it from the command's primary config."""
    from hydra import compose, initialize_config_dir

    primary = evaluate.eval_config(_run(tmp_path), "sqlite:///x.db", REPO / "conf", overrides,
                                   str(tmp_path / "model.pt"), "1x8x8", 10)
    # `--config-dir` in the command; conf/ (the groups) searched after it, as there.
    primary["hydra"]["searchpath"] = [f"file://{REPO / 'conf'}"]
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(primary, sort_keys=False))
    register_schema()
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        return compose(config_name="eval", overrides=overrides)


def test_the_evaluating_job_keeps_the_runs_data_unless_data_is_swapped(tmp_path: Path) -> None:
    kept = _compose_eval(tmp_path, ["distributed.nproc_per_node=3"])
    assert (kept.data.name, kept.data.batch_size) == ("digits", 32)  # the run's own setting
    assert kept.eval.run_id == "a" * 32 and kept.eval.trained_shape == "1x8x8"
    assert kept.tracking.enabled is False and kept.tracking.rerun_of is None
    assert kept.distributed.nproc_per_node == 3
    swapped = _compose_eval(tmp_path, ["data=synthetic", "eval.name=noise"])
    assert (swapped.data.name, swapped.data.batch_size) == ("synthetic", 256)  # its defaults
    assert swapped.eval.name == "noise"


@pytest.mark.parametrize(("verb", "did"), [("eval", "evaluating"), ("predict", "predicting")])
def test_a_failed_evaluation_or_prediction_is_named_so_and_starts_again(
        tmp_path: Path, verb: str, did: str) -> None:
    """Not "the training job failed ... kept: nothing: no checkpoint yet": it kept nothing to
    resume, and its command starts it again, without the output directory that failed."""
    from train.launch.outcomes import failure_block

    command = f"python -m train {verb} {'a' * 32} {verb}.split=val hydra.run.dir={tmp_path}"
    block = failure_block("rank 1 on vm: ValueError: bad", tmp_path, command).splitlines()
    assert block[0] == f"the {did} job failed; rank 1 on vm: ValueError: bad"
    assert block[1] == f"  start again: python -m train {verb} {'a' * 32} {verb}.split=val"
    assert not [line for line in block if "kept" in line or "resume" in line]
