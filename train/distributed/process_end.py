"""How a process of the service ends once its work is done: as the interpreter's own ending
does - its other threads joined, its exit handlers run, its streams flushed, the exit code kept -
but without the interpreter then tearing down every module. With torch, torch._dynamo and
MLflow imported, that teardown held a finished process for 1.7-3 s of CPU (a one-task srun step
of such a process: 8.9 s instead of 5.8 s on 2026-12-04), for every rank of every Slurm job and
after every `python -m train`, with the node still allocated meanwhile. Nothing of the user's
is in it: the service writes and closes its files itself; logging's handlers, multiprocessing's
children and temporary folders are ended by the exit handlers, which still run.

Local ranks end this way already (multiprocessing's forked children `os._exit`); this module is
for the processes the service's own code ends: `python -m train` (train/__main__.py), and a rank
or a node's task that submitit started (train/engine/job.py, train/app.py). No torch at import.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

SUBMITIT_MAIN = "submitit.core._submit"
"""The module submitit runs as a Slurm task's __main__: it pickles a rank's result after the
rank returned, then the interpreter ends."""


def end_process(code: int) -> NoReturn:
    """End now with `code`, after what the interpreter would do first at its end."""
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream ends nothing
            stream.flush()
    os._exit(code)


def exit_code(exit: SystemExit) -> int:
    """The code the interpreter gives a SystemExit: None is 0, a message is printed and 1."""
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def end_quickly_under_submitit() -> None:
    """For a rank that returned in a task submitit started: once submitit has written the
    result and its main returned, the first exit handler ends the process (code 0, what a
    main that returned gets). An uncaught exception on its way out (one printed since now:
    `sys.last_value`) is left to the interpreter's own ending and exit code. Anywhere else a
    caller's code may still choose its exit code, so nothing changes there."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) != SUBMITIT_MAIN:
        return
    atexit.register(_end_after_a_clean_return, getattr(sys, "last_value", None))


def _end_after_a_clean_return(last_error_before: BaseException | None) -> None:
    atexit.unregister(_end_after_a_clean_return)
    if getattr(sys, "last_value", None) is not last_error_before:
        return
    end_process(0)
