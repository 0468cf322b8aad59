"""Imported by the ranks' fork server for a job on data=arrow (train/launch/local.py,
`preloads`): `datasets`, and the pandas and pyarrow it imports at its top - ~1 s of CPU that
each rank spent after the fork, which made an Arrow job's first step later than the same job's
on an image folder.

Importing pyarrow starts the background thread of its own jemalloc, which purges freed pages
every so often; a process that forks should hold no threads of its own beyond torch's (see
train/launch/fork_server.py). jemalloc's option turns that thread off before the library
loads, for the server and the ranks it forks (they inherit the allocator as it is): freed
pages are then purged as memory is next allocated, on the same decay. A user who set
JE_ARROW_MALLOC_CONF keeps it, and then the ranks import `datasets` themselves, as before.
"""

from __future__ import annotations

import os

JEMALLOC_OPTIONS = "JE_ARROW_MALLOC_CONF"
"""pyarrow's jemalloc (built with the prefix je_arrow_) reads its options from here."""

if JEMALLOC_OPTIONS not in os.environ:
    os.environ[JEMALLOC_OPTIONS] = "background_thread:false"
    try:
        import datasets  # noqa: F401
    finally:  # the ranks' environment is the launcher's, passed to each; keep this one as it
        del os.environ[JEMALLOC_OPTIONS]
