"""One request of rank 0's sender (train/tracking/run.py), tried until the store takes it.

A transient failure (errors.is_permanent says which) is tried again, at most a few seconds
apart; a permanent one, or the run's end giving up on MLflow (`given_up`: finish() saved the
rest to the unsent file), ends the sender instead (`GivenUp`). No mlflow at import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from train.tracking import errors

log = logging.getLogger(__name__)


class GivenUp(Exception):
    """The run ended without MLflow; what was left went to the unsent file. `why`: the store's
    permanent refusal, in one line, when that is what ended it (None: finish() gave up)."""

    def __init__(self, why: str | None = None) -> None:
        super().__init__(why)
        self.why = why


def until_taken(request: Callable[[], None], given_up: threading.Event) -> None:
    """Until `request` succeeds; GivenUp when it failed permanently or `given_up` is set."""
    delay = 0.5
    while True:
        try:
            request()
            return
        except Exception as e:  # noqa: BLE001 - a tracking outage must not stop training
            if errors.is_permanent(e):
                why = errors.describe(e)
                log.error("MLflow refused a request and will refuse it again (%s): no "
                          "more requests for this run; the rest goes to the unsent file "
                          "at its end", why)
                raise GivenUp(why) from None
            if given_up.is_set():
                raise GivenUp from None
            log.warning("MLflow request failed (%s); retrying in %.0f s",
                        errors.describe(e), delay)
            if given_up.wait(delay):
                raise GivenUp from None
            # At most a few seconds apart: a server back from an outage is reached within
            # seconds of its return (a failing try to a server that is down costs nothing).
            delay = min(delay * 2, 4.0)
