"""trainer.profile (train/engine/profiling.py) in process: what pre-flight refuses. A profiled
job's traces, summaries, tag and artifacts: tests/e2e/test_end_to_end.py and
tests/cluster/test_slurm.py. The profiler is not run in the pytest process itself: kineto's
stop_trace aborted it there (SIGABRT, a pytest-xdist worker lost, the run hung)."""

from __future__ import annotations

import pytest

from tests.conftest import typed
from train.config.validation import validate
from train.errors import ConfigError


def test_a_window_without_a_recorded_step_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.profile: wait=5 and warmup=1 must be 0 or "
                                          r"more and active=0 positive"):
        validate(typed("trainer.profile.enabled=true", "trainer.profile.active=0"), 1)
