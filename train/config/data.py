"""The data group's keys: which data set, where it is, how it is split, batched, read and
augmented, with a docstring per field like train/config/groups.py's (which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    name: str = "digits"
    """The data set: digits, synthetic, mnist, fashion_mnist, cifar10 (held in memory); or
    imagefolder, arrow, custom, tokens (streamed from disk by DataLoader workers). Set by the
    group option."""
    batch_size: int = 64
    """GLOBAL batch size, split evenly over all ranks."""
    val_fraction: float = 0.2
    """Share of the training split held out for validation (fixed split seed)."""
    split_seed: int = 0
    """Seed of the train/val split; the same for every rank and every restart."""
    root: str = "${oc.env:TRAIN_DATA_ROOT,data}"
    """Where torchvision data sets live (env TRAIN_DATA_ROOT overrides); imagefolder: the folder
    of class folders, or of train/ and val/ holding them; arrow: the directory prepare-data or
    datasets' save_to_disk wrote, or a Hub data set's name (owner/name[:config]) found in the
    local datasets cache ($HF_DATASETS_CACHE; never downloaded)."""
    download: bool = False
    """Download missing torchvision data sets (compute nodes are often offline)."""
    num_workers: int | None = None
    """DataLoader workers per rank; null = what the CPUs available to each rank allow (one CPU
    per rank left to training; in-memory sets up to 4, streamed ones 1 to 8)."""
    on_device: bool = True
    """Keep the in-memory data set on the GPU (shuffle, augment and batch there)."""
    augment: bool = False
    """Augment training batches: in-memory sets a random crop (pad 4) and horizontal flip on the
    device; imagefolder the default train_transforms (else training uses the eval ones)."""
    num_samples: int = 4096
    """synthetic: number of samples."""
    seq_len: int = 256
    """tokens: tokens per window (a sample): the model's context must hold it (model=gpt's
    block_size defaults to it)."""
    channels: int = 3
    """synthetic: image channels."""
    image_size: int = 32
    """synthetic: image height and width; imagefolder: the side of the default transforms'
    square crop."""
    num_classes: int = 10
    """synthetic: number of classes."""
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    """imagefolder: per-channel mean of Normalize (ImageNet's), applied on the device."""
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    """imagefolder: per-channel standard deviation of Normalize (ImageNet's)."""
    train_transforms: list[Any] | None = None
    """imagefolder: transforms.v2 steps for training images, each {_target_:
    torchvision.transforms.v2.<Name>, <its arguments>}, on the decoded uint8 image (the device
    then converts and normalises); null = RandomResizedCrop(image_size) + RandomHorizontalFlip
    (with augment=false: the eval steps)."""
    eval_transforms: list[Any] | None = None
    """imagefolder: the same for validation; null = Resize(image_size / 0.875) +
    CenterCrop(image_size)."""
    train: Any = None
    """custom: the training Dataset, {_target_: <dotted path>, <its own arguments>}, built with
    hydra.utils.instantiate; sample i is (input tensor, integer label)."""
    val: Any = None
    """custom: the validation Dataset, as `train`; no _target_ = split off `train` by
    val_fraction."""
    test: Any = None
    """custom: the test Dataset, as `train`, evaluated once after training
    (trainer.test_on); no _target_ = no test phase."""
    input_column: str = "auto"
    """arrow: the column the model reads; auto = the manifest's (prepare-data), else the first
    image column, else image / input / pixel_values / x / text / sentence / tokens."""
    target_column: str = "auto"
    """arrow: the target's column; auto = the manifest's, else label / labels / target(s) /
    ner_tags / tags. A list per row (a tag per word of a column of words): one target per
    token, for task=token_classification."""
    tokenizer: str | None = None
    """arrow with a text input column: the tokenizer (a `tokenizers` JSON file, or a directory
    holding tokenizer.json as save_pretrained writes it) that turns each text into token ids in
    the DataLoader's workers, padded (its [PAD] or <pad> token) and truncated to max_length."""
    max_length: int = 128
    """arrow with a text input column: token ids per sample."""
    tokenize: str = "workers"
    """arrow with a text input column: workers = each batch's texts tokenized in the
    DataLoader's workers as they are read (nothing written); map = the whole set tokenized
    once per node before training (datasets' map) and cached in tokenized_to, reused while the
    data, tokenizer and max_length stay the same."""
    tokenized_to: str | None = None
    """tokenize=map: where the tokenized set is kept (a directory every node sees; '$VARS'
    expanded on the node); null = <root>/.tokenized."""
    shuffle: str = "shards"
    """arrow: the training order. shards: the shards in a random order, then the samples of
    each window of shuffle_window shards (reads stay in a few files); global: one permutation
    of all samples (reads all over the set)."""
    shuffle_window: int = 4
    """arrow, shuffle=shards: shards whose samples are mixed together."""
    stage_to: str | None = None
    """arrow: node-local storage to copy the data set to before training, once per node
    (e.g. '$TMPDIR', quoted: expanded on the node); null = read it where it is."""


DATASETS_WITHOUT_FILES = frozenset({"digits", "synthetic"})
"""Data sets that need nothing on disk: bundled with scikit-learn, or generated."""


def reads_files(data: DataConfig) -> bool:
    """Whether the data set must already be on disk (pre-flight checks it is)."""
    return data.name not in DATASETS_WITHOUT_FILES and not data.download
