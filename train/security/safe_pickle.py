"""Unpickling data files (CIFAR-10's batches) that may not be the user's own: plain containers
and numpy arrays only.

A pickle names the functions it calls to rebuild its objects; `pickle.load` calls any of them
(os.system included), so a file planted in a shared data.root ran code as the user who read it
(on the login node, during pre-flight). This unpickler resolves only what a numpy array needs;
anything else is refused before it is called.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 3 writes bytes in protocol 2 (no code runs)
}


class UnsafePickleError(pickle.UnpicklingError):
    """The file asks for something other than plain data; nothing of it was run."""


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise UnsafePickleError(f"it asks to call {module}.{name}, and only plain arrays, lists "
                                "and dicts are read")


def load(path: Path) -> Any:
    """The data pickled in `path` (Python 2 pickles: str read as latin1, as torchvision does)."""
    with open(path, "rb") as f:
        try:
            return _ArraysOnly(f, encoding="latin1").load()
        except UnsafePickleError as e:
            raise UnsafePickleError(f"Refusing to read {path}: {e}. Replace it with the "
                                    "official file (or your own arrays).") from None
