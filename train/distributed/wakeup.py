"""A signal that wakes a thread instead of running code inside the signal: the watchdog's
answer to SIGUSR1 (train/distributed/watch.py).

Python's C-level handler writes each handled signal's number to the wakeup fd at once, whatever
the main thread is doing (a collective, a sleep); the watchdog thread reads it and does the work
with the GIL held. faulthandler's own signal handler instead dumps the threads from inside the
signal, reading their frames while they change them: that crashed a rank (a segmentation fault
in CI, while its MLflow thread built pydantic schemas). The standard library only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import select
import signal
import socket
import threading
from collections.abc import Callable
from typing import TextIO


def on_signal(signum: int, fallback: TextIO) -> tuple[socket.socket | None, Callable[[], None]]:
    """`signum` written to a socket for `wait`, and how to undo it. Only the main thread may set
    signals: elsewhere (a test's in-thread rank) faulthandler answers into `fallback` itself
    and the socket is None."""
    if threading.current_thread() is not threading.main_thread():
        faulthandler.register(signum, file=fallback, all_threads=True)
        return None, lambda: faulthandler.unregister(signum)
    read, write = socket.socketpair()
    for end in (read, write):
        end.setblocking(False)
    handler = signal.signal(signum, lambda *_: None)  # its C part is what counts
    previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)

    def restore() -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # cannot be undone here: left set, the socket with it
        signal.set_wakeup_fd(previous)
        signal.signal(signum, handler)
        read.close()
        write.close()
    return read, restore


def wait(wake: socket.socket | None, signum: int, timeout: float,
         stop: threading.Event) -> bool:
    """Up to `timeout` seconds, less once a signal came; whether `signum` was among those that
    came (every signal with a Python handler lands on the socket: the others are dropped)."""
    if wake is None:
        stop.wait(timeout)
        return False
    if not select.select([wake], [], [], timeout)[0]:
        return False
    with contextlib.suppress(OSError):
        return signum in wake.recv(4096)
    return False
