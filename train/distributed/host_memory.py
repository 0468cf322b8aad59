"""distributed.keep_host_memory: glibc's malloc told to keep the host memory a step frees for
the next step, rather than give it back to the OS and fault it in again page by page. No torch
import: a rank calls it before it builds its data and model (engine/job.py), and the DataLoader
workers it forks inherit the settings.
"""

from __future__ import annotations

import ctypes
import platform

HEAP_BELOW_BYTES = 32 << 20
"""Blocks smaller than this come from the heap: glibc's own ceiling for its dynamic threshold,
held from the start (glibc's default begins at 128 KiB: each larger block a fresh mmap, zero-
filled page by page at first touch, unmapped again when freed)."""
KEEP_FREE_BYTES = 512 << 20
"""Freed memory at the top of the heap up to this is kept, not given back (glibc's default
trims above 128 KiB, or twice the dynamic threshold): a step's temporaries fit in it."""
HEAP_ROOM_BYTES = 14 * (31 << 20)
"""Room made at the heap's top at the start (address space: a page becomes memory when first
touched, and stays). glibc serves a block of HEAP_BELOW_BYTES or more from the heap's top when
it has room there, else from a fresh mmap each time; 32 MiB is glibc's ceiling for the
threshold, and one conv activation of a CPU batch is that size (128 x 64 x 32 x 32 floats).
Training's backward grows the heap beyond it by itself; a process that only runs forwards
(`eval`, `predict`) otherwise faulted 377,000 pages back in at each pass over 3,000 samples
(2.4-2.7 s a pass; with the room: 2.0 s, no faults after the first). Under KEEP_FREE_BYTES, so
the room is kept."""
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def keep_host_memory(enabled: bool) -> bool:
    """distributed.keep_host_memory: this process keeps freed host memory for reuse (see
    DistributedConfig), before its DataLoader workers fork (they inherit it). True when set:
    glibc only (musl or macOS: their allocator's defaults)."""
    if not enabled or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    # Setting either also stops glibc's dynamic threshold, which rises only as blocks are
    # freed and whose trimming still gave a conv net's step 17,000 page faults (measured).
    applied = bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_BELOW_BYTES)
                   and libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES))
    if applied:
        _make_heap_room(libc)
    return applied


def _make_heap_room(libc: ctypes.CDLL) -> None:
    """HEAP_ROOM_BYTES at the top of the heap: blocks under the mmap threshold taken from it in
    turn (the heap grows; nothing is touched) and freed in reverse, each joining the free top."""
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    block = HEAP_BELOW_BYTES - (1 << 20)
    taken = [libc.malloc(block) for _ in range(HEAP_ROOM_BYTES // block)]
    for address in reversed(taken):
        libc.free(address)  # NULL (no room): free does nothing
