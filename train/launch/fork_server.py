"""The local launcher's fork server (multiprocessing's forkserver), which forks the ranks:
what it imports before the first fork, and its end with the launcher that started it.

Imported by the fork server alone, as its preload (train/launch/rank_server.py, `rank_context`):
torch, the training code, and torch._dynamo, which DDP's constructor imports in every rank.
Each spawned rank used to import them anew (~3.5 s of CPU per rank here; eight ranks importing
at once from a parallel filesystem, seconds more). None of these imports initialises CUDA,
and the one thread they start, numpy's OpenBLAS pool, is shut down by OpenBLAS's own fork
handler before every fork (and started again at the next BLAS call: checked, one thread left
in the parent after a fork), so forking after them is safe - the fork DataLoader workers have
always made after `import torch`.

The server dies with its launcher, even one killed by SIGKILL: the ranks have it as their
parent, so their death signal (rank_process.end_with) fires when it ends. CPython's own way
for it to end (a pipe that closes when the launcher exits) waits for every rank to end too,
since each rank inherits the pipe's other end in order to start processes of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

from train.distributed.env import FORK_SERVER_VAR

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_launcher() -> None:
    """In the fork server: SIGKILL when its launcher dies (it holds no state to save). Only
    when the launcher named itself as this process's parent: imported anywhere else, this
    module does nothing but import."""
    launcher = os.environ.pop(FORK_SERVER_VAR, None)
    if launcher is None:
        return
    with contextlib.suppress(AttributeError, OSError):  # Linux only; elsewhere: best effort
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the line above
        os._exit(1)


end_with_launcher()

import torch._dynamo  # noqa: E402,F401

import train.engine.job  # noqa: E402,F401
