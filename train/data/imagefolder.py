"""What an ImageFolder data set holds on disk: its layout, classes and image files.

torchvision's ImageFolder layout, in one of two forms under data.root:
  root/train/<class>/**/<image> and root/val/<class>/**/<image>   (and root/test/: the test split)
  root/<class>/**/<image>   (or root/train/ alone): validation split off by data.val_fraction
Classes are the sorted folder names; files are listed in torchvision's order (sorted os.walk),
so the classes, labels and split are those torchvision.datasets.ImageFolder would give.

No torch here: pre-flight scans the layout in the launching process before any rank starts, and
refuses what is not an ImageFolder with one line that says what to do.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from train.errors import TrainError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision's IMG_EXTENSIONS (any case)."""
LAYOUT = "root/<class>/<image>, or root/train/<class>/<image> and root/val/<class>/<image>"


class LayoutError(TrainError, ValueError):
    """data.root is not an ImageFolder data set; the message says what to change."""


@dataclass
class ClassFolder:
    """One folder of class folders: root/<class>/**/<image>."""

    path: Path
    classes: list[str]
    files: list[str]
    """Image paths relative to `path` ("<class>/<file>"), class by class, sorted."""
    labels: list[int]
    """Class index of each file."""

    def __len__(self) -> int:
        return len(self.files)

    def digest(self) -> str:
        """Names the file list and labels (not the pixels: reading every file is too slow)."""
        h = hashlib.sha256()
        for name, label in zip(self.files, self.labels, strict=True):
            h.update(f"{name}\0{label}\n".encode())
        return h.hexdigest()


@dataclass
class Layout:
    train: ClassFolder
    val: ClassFolder | None
    """None: validation is split off `train` by data.val_fraction."""
    test: ClassFolder | None = None
    """root/test/ beside train/: the test split (evaluated once after training)."""

    def describe(self) -> str:
        classes = len(self.train.classes)
        val = (f"{len(self.val)} in {self.val.path}" if self.val is not None
               else "split off by data.val_fraction")
        return f"{len(self.train)} images in {classes} classes in {self.train.path}; val: {val}"


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _subfolders(path: Path) -> list[str]:
    """Visible subfolder names, sorted (.ipynb_checkpoints and the like are no classes)."""
    with os.scandir(path) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def _images_under(folder: Path) -> list[str]:
    """Image files anywhere under `folder`, relative to it, in torchvision's order."""
    found = []
    for where, dirs, names in sorted(os.walk(folder, followlinks=True)):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = os.path.relpath(where, folder)
        found += [name if rel == "." else os.path.join(rel, name)
                  for name in sorted(names) if _is_image(name)]
    return found


def scan(path: Path) -> ClassFolder:
    """The class folders under `path` and their image files; refuses empty ones."""
    classes = _subfolders(path)
    if not classes:
        loose = sum(1 for name in os.listdir(path) if _is_image(name))
        found = f"{loose} image files but no class folders" if loose else "no class folders"
        raise LayoutError(f"{path} holds {found}: an ImageFolder data set wants one folder per "
                          f"class with the images inside ({LAYOUT}).")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        images = _images_under(path / name)
        if not images:
            raise LayoutError(f"class folder {path / name} has no images (extensions "
                              f"{', '.join(IMAGE_EXTENSIONS)}): add some or remove the folder.")
        files += [os.path.join(name, image) for image in images]
        labels += [label] * len(images)
    return ClassFolder(path, classes, files, labels)


def _same_classes(train: ClassFolder, val: ClassFolder) -> None:
    for have, lack in ((train, val), (val, train)):
        if missing := [c for c in have.classes if c not in lack.classes]:
            raise LayoutError(
                f"class {missing[0]!r} is in {have.path} but not in {lack.path}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: every class "
                "needs images in both, or remove val/ to split train/ by data.val_fraction.")


def find(root: str) -> Layout:
    """The layout under data.root, checked: what training and validation read."""
    path = Path(root).expanduser()
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise LayoutError(f"data.root={root!r} {what}: data=imagefolder wants a folder laid out "
                          f"as {LAYOUT}.")
    if not (path / "train").is_dir():
        return Layout(scan(path), None)
    train = scan(path / "train")
    if not (path / "val").is_dir():
        return Layout(train, None)
    val = scan(path / "val")
    _same_classes(train, val)
    test = scan(path / "test") if (path / "test").is_dir() else None
    if test is not None:
        _same_classes(train, test)
    return Layout(train, val, test)


def known_input(root: str, image_size: int) -> tuple[tuple[int, ...], int] | None:
    """(one sample's shape, number of classes) before any image is read: RGB crops of
    `image_size`, the class folders; None where the layout is wrong (pre-flight's data check
    says what is wrong with it)."""
    try:
        classes = len(find(root).train.classes)
    except (LayoutError, OSError):
        return None
    return (3, image_size, image_size), classes
