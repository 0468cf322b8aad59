"""data.stage_to: a data=arrow set copied to node-local storage once per node before training."""

from __future__ import annotations

import logging
from pathlib import Path

from train.data.arrow import digest, find

log = logging.getLogger("train")


def staged(root: str | Path, stage_to: str) -> Path:
    """data.stage_to: the data set copied into node-local storage (`$TMPDIR` is expanded on
    the node), once per node whatever its number of ranks - the first process there copies it
    under a lock into a temporary directory renamed into place, the others wait for it and
    read the copy. A copy already there (an earlier job, or a requeue) is used as it is; its
    name holds the set's digest, so a changed set gets a new copy."""
    import fcntl
    import os
    import shutil

    layout = find(root)
    base = Path(os.path.expandvars(stage_to)).expanduser()
    target = base / f"{layout.root.name}-{digest(layout)}"
    if (target / ".staged").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait here for the copy
        if not (target / ".staged").is_file():
            partial = base / f".{target.name}.{os.getpid()}.tmp"
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(layout.root, partial)
            (partial / ".staged").write_text(f"copied from {layout.root}\n")
            os.replace(partial, target)
            log.info("data: staged %s to %s", layout.root, target)
    return target
