"""distributed.keep_host_memory: a rank keeps the host memory a step frees for the next one.

Each case runs in a fresh interpreter (glibc's malloc settings are per process, and this one's
heap has a history): a "step" fills ten 8 MiB tensors and frees them all, as a conv net's
activations are; the minor page faults of each later step are what the OS had to fault in
again. How many the first steps fault depends on the heap's layout, which differs from one
process to the next (below).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.conftest import REPO
from train.distributed import host_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only: other C libraries keep their own")

STEPS = """
import json, resource, sys
import torch
from train.distributed import host_memory
applied = host_memory.keep_host_memory(sys.argv[1] == "true")
def step():
    blocks = [torch.empty(8 << 18).fill_(1.0) for _ in range(10)]  # touched
    del blocks
step()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES_PER_STEP = 10 * (8 << 20) // 4096
"""The pages one step touches: what it faults in when none is kept."""


def _probe(script: str, keep: bool) -> dict:
    """The JSON line `script` prints in a fresh interpreter, with keep_host_memory on or off."""
    done = subprocess.run([sys.executable, "-c", script, str(keep).lower()], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_step_memory_is_kept_for_the_next_step_unless_turned_off() -> None:
    """Kept: the first steps still fault in pages of the room they had not touched yet (steps 2
    and 3: 0-18,430 of the 20,480), then none - from the fourth step on, 0 in each of 13
    processes (measured 2026-11-28). glibc's default gives the first step's blocks back at once
    (each a fresh mmap), so step 2 faults in the whole step again (20,477 in 10 of 10); after
    that it either faults in 16,000-20,500 pages every step (the freed blocks at the heap's
    top, trimmed) or settles like the kept heap (3 of 10: something allocated above them), so
    the later steps are compared for the kept heap alone."""
    kept, default = _probe(STEPS, True), _probe(STEPS, False)  # steps 2-9's faults
    assert kept["applied"] is True and default["applied"] is False
    assert max(kept["faults"][2:]) <= PAGES_PER_STEP // 100, (kept, default)
    assert default["faults"][0] >= PAGES_PER_STEP // 2, (kept, default)


HEAP = """
import json, sys
import torch
from train.distributed import host_memory
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start, end
    return 0, 0
applied = host_memory.keep_host_memory(sys.argv[1] == "true")
room = heap()
block = torch.empty(16 << 18).fill_(1.0)  # 16 MiB, touched
address, during = block.data_ptr(), heap()
del block
print(json.dumps({"applied": applied, "heap_mb": (room[1] - room[0]) >> 20,
                  "in_heap": during[0] <= address < during[1], "kept": heap() == during}))
"""


def test_the_heap_has_room_at_the_start_and_serves_large_blocks_and_keeps_them() -> None:
    """What keep_host_memory sets, read from the process's own map: the room made at the heap's
    top (host_memory.HEAP_ROOM_BYTES, address space), a 16 MiB tensor served from the heap
    rather than a fresh mmap (glibc's default: above 128 KiB), and the heap not shrunk once it
    is freed. (Whether 32 MiB blocks then come from that room too - no page faults at each
    pass - depends on the heap's layout: measured 2,048-20,477 faults a step of three, from
    process to process, against 24,579 without; not asserted.)"""
    kept, default = _probe(HEAP, True), _probe(HEAP, False)
    assert kept["applied"] and not default["applied"]
    assert kept["heap_mb"] >= host_memory.HEAP_ROOM_BYTES >> 20, kept
    assert kept["in_heap"] and kept["kept"], kept
    assert not default["in_heap"], default  # a fresh mmap, unmapped again when freed
