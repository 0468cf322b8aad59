"""The failure drill is a test's environment variable (TRAIN_FAIL_DRILL), not user config; how
a job ends when its rank fails: tests/e2e/test_distributed.py, test_sweeps.py."""

from __future__ import annotations

import pytest

from tests.conftest import composed
from train.engine import drill


@pytest.mark.parametrize(("value", "rank", "out", "expected"), [
    ("", 0, "/o/job", None),
    ("1:3", 1, "/o/job", 3),
    ("1:3", 0, "/o/job", None),
    ("0/0:0,1/0:1", 0, "/sweep/0", 0),
    ("0/0:0,1/0:1", 0, "/sweep/1", 1),
    ("0/0:0,1/0:1", 0, "/sweep/2", None),
])
def test_the_drill_names_a_rank_a_step_and_optionally_a_sweep_job(
        monkeypatch: pytest.MonkeyPatch, value: str, rank: int, out: str,
        expected: int | None) -> None:
    monkeypatch.setenv(drill.ENV, value)
    assert drill.fail_at(rank, out) == expected


def test_a_due_drill_raises_and_a_malformed_one_says_the_form(
        monkeypatch: pytest.MonkeyPatch) -> None:
    drill.check(None, 0, 0)
    drill.check(3, 2, 1)
    with pytest.raises(drill.FailureDrill, match="rank 1 failing on purpose at step 3"):
        drill.check(3, 3, 1)
    monkeypatch.setenv(drill.ENV, "rank1")
    with pytest.raises(ValueError, match="RANK:STEP or JOB/RANK:STEP"):
        drill.fail_at(0, "/o")


def test_the_drill_is_no_key_of_the_config() -> None:
    assert not [k for k in composed().trainer if "fail" in k]
