"""data=arrow data.root=<a Hub name>: a Hugging Face data set read from the local `datasets`
cache, where `load_dataset` left it after a download on a machine that reaches the Hub - the
compute nodes never do (python -m train sets HF_HUB_OFFLINE unless the user did). The cache
directory it resolves to is read as any other (train/data/arrow.py `find`)."""

from __future__ import annotations

import re
from pathlib import Path

from train.data.arrow import ArrowDataError

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")
"""`name`, `owner/name`, either with `:config`: a data set of the Hub as `datasets` names it."""


def hub_cache(name: str) -> Path:
    """The directory of the local `datasets` cache ($HF_DATASETS_CACHE) that holds the Hub data
    set `name` (`owner/name[:config]`), as `load_dataset` offline finds it - never downloaded
    (python -m train sets HF_HUB_OFFLINE unless the user did)."""
    import datasets

    path, _, config = name.partition(":")
    try:
        builder = datasets.load_dataset_builder(path, config or None)
    except (ConnectionError, ValueError, FileNotFoundError) as e:
        raise ArrowDataError(f"data=arrow data.root={name}: neither a directory nor a data set "
                             f"in the local datasets cache ({datasets.config.HF_DATASETS_CACHE}"
                             f"): {str(e).splitlines()[0]} - load it once where the Hub can be "
                             "reached (datasets.load_dataset), or give a directory.") from None
    folder = Path(builder.cache_dir)
    if not list(folder.glob("*.arrow")):
        raise ArrowDataError(f"data=arrow data.root={name}: the datasets cache has no Arrow "
                             f"files for it ({folder}): load it once with datasets.load_dataset.")
    return folder
