"""Whether DataLoader workers can pass batches here: light (no torch), so that the launching
process checks it in pre-flight without importing torch (train/launch/preflight.py), and every
rank again before it makes workers (train/data/batches.py: a Slurm node's own TMPDIR)."""

from __future__ import annotations

import tempfile

SOCKET_PATH_MAX = 107
"""The longest Unix socket path Linux takes (sun_path: 108 bytes with the closing NUL)."""
MP_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")
"""What Python's multiprocessing adds to the temporary directory for the socket through which
a DataLoader worker hands its batch's shared memory to the rank."""


def temp_dir_problem(workers: int) -> str | None:
    """Why `workers` DataLoader workers cannot work here, if they cannot: they hand batches over
    through a Unix socket made under the temporary directory; with a longer path the socket
    cannot be made, the worker's batch is lost (a traceback in a background thread) and the
    rank waits for it forever (measured: a TMPDIR of 85 characters hung the default job)."""
    temp = tempfile.gettempdir()
    if workers == 0 or len(temp) + MP_SOCKET_SUFFIX <= SOCKET_PATH_MAX:
        return None
    return (f"the temporary directory {temp} ({len(temp)} characters, from TMPDIR) is too long "
            f"for the sockets DataLoader workers pass batches through (at most "
            f"{SOCKET_PATH_MAX - MP_SOCKET_SUFFIX} characters): set TMPDIR to a shorter "
            "directory, e.g. TMPDIR=/tmp, or use data.num_workers=0.")
