"""model=hf: a Hugging Face `transformers` model trained as the service's own.

Built from a local directory (`model.path`: `from_pretrained`, offline - never the Hub) or from
a config (`model.config.model_type=gpt2 +model.config.n_layer=4`: `from_config`, random
weights from the job's seed, the same on every rank). The sizes the data knows are filled
where the config does not set them (conf/model/hf.yaml; the model=custom rule: vocab_size and
the context for token windows, num_labels, image_size and num_channels for images).

`HFModel` wraps it so that its forward returns the logits - what every task reads; the model's
own loss is never asked for (no labels are passed). Its blocks are the modules of its
ModuleLists (GPT2Block, ViTLayer, BertLayer, ...: its `_no_split_modules`), which FSDP shards
and activation checkpointing recomputes. `save_pretrained` writes what `transformers` loads
back without this package (train/engine/outputs.py logs it as the run's `hf_model/`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train.config.usercode import UserCodeError

log = logging.getLogger("train")
AUTO_CLASSES = {"causal_lm": "AutoModelForCausalLM",
                "sequence_classification": "AutoModelForSequenceClassification",
                "token_classification": "AutoModelForTokenClassification",
                "image_classification": "AutoModelForImageClassification"}
"""model.auto_class's short names; any other name is a transformers Auto class itself."""
PIXELS = ("image_classification", "AutoModelForImageClassification")
INSTALL = "pip install -e '.[hf]' (make setup installs it)"
EXPORT_DIR = "hf_model"
"""The save_pretrained directory beside model.pt, and its artifact path in the run."""


class HFModel(nn.Module):
    """A transformers model whose forward takes the batch's tensor (token ids, or pixels) and
    returns its logits."""

    def __init__(self, model: nn.Module, input_name: str, pad_id: int | None = None) -> None:
        super().__init__()
        self.model, self.input_name, self.pad_id = model, input_name, pad_id

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.model.config, "vocab_size", None)

    @property
    def block_size(self) -> int | None:
        """The context: what data.seq_len must fit (pre-flight reads it)."""
        config = self.model.config
        return getattr(config, "n_positions", getattr(config, "max_position_embeddings", None))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.pad_id is None:
            return self.model(**{self.input_name: inputs}).logits
        return self.model(input_ids=inputs, attention_mask=inputs.ne(self.pad_id)).logits

    def save_pretrained(self, folder: Path, tokenizer: str | None = None,
                        pad_tokens: tuple[str, ...] = ()) -> Path:
        """The model as `transformers` keeps it (config.json, model.safetensors), with the
        data's tokenizer where it is a `tokenizers` file (`tokenizer`: its path), so that
        AutoTokenizer.from_pretrained(folder) reads text as the model was trained on it; its
        padding token the first of `pad_tokens` it holds."""
        transformers = _transformers()
        transformers.utils.logging.disable_progress_bar()  # a bar in train.log, per file
        self.model.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None and Path(tokenizer).is_file():
            fast = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer)
            vocab = fast.get_vocab()  # its padding token named, so that padding=True works
            fast.pad_token = next((t for t in pad_tokens if t in vocab), None)
            fast.save_pretrained(folder)
        return folder


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UserCodeError(f"model=hf needs the transformers package, not installed here: "
                            f"{INSTALL}.") from None
    return transformers


def find_auto_class(name: str) -> Any:
    """model.auto_class's transformers class; UserCodeError naming the choices."""
    transformers = _transformers()
    found = getattr(transformers, AUTO_CLASSES.get(name, name), None)
    if found is None or not name.startswith(("Auto", *AUTO_CLASSES)):
        raise UserCodeError(f"model.auto_class={name!r}: choose {', '.join(AUTO_CLASSES)} or "
                            "a transformers Auto class (AutoModelForMaskedLM, ...).")
    return found


def _filled(config: dict[str, Any], name: str, sizes: dict[str, int | None]) -> dict[str, Any]:
    """The config's overrides with what the data knows, where the user set nothing: images'
    sizes and classes; token ids' vocabulary (and padding id), and a classifier's classes."""
    out = dict(config)
    if name in PIXELS:
        wanted = {"num_labels": sizes["num_classes"], "image_size": sizes["image_size"],
                  "num_channels": sizes["channels"]}
    else:
        wanted = {"vocab_size": sizes["vocab_size"], "pad_token_id": sizes["pad_token_id"]}
        if name != "causal_lm":
            wanted["num_labels"] = sizes["num_classes"]
    out.update({k: v for k, v in wanted.items() if v is not None and k not in out})
    return out


def build(auto_class: str = "causal_lm", path: str | None = None,
          config: dict[str, Any] | None = None, vocab_size: int | None = None,
          seq_len: int | None = None, num_classes: int | None = None,
          channels: int | None = None, image_size: int | None = None,
          pad_token_id: int | None = None, class_names: list[str] | None = None) -> HFModel:
    """The model (see the module's docstring). `seq_len`: taken, so that the filling rule
    hands it, but the config's own context (n_positions, max_position_embeddings) decides."""
    del seq_len
    model_class = find_auto_class(auto_class)
    sizes = {"vocab_size": vocab_size, "num_classes": num_classes, "channels": channels,
             "image_size": image_size, "pad_token_id": pad_token_id}
    if path is not None:
        model = _pretrained(model_class, Path(path).expanduser(), dict(config or {}),
                            auto_class, sizes)
    else:
        model = _from_config(model_class, _filled(dict(config or {}), auto_class, sizes))
    if class_names and auto_class != "causal_lm" \
            and getattr(model.config, "num_labels", None) == len(class_names):
        # the classes' names in the config, as transformers' pipelines and users read them
        model.config.id2label = dict(enumerate(class_names))
        model.config.label2id = {name: i for i, name in enumerate(class_names)}
    if vocab_size is not None and getattr(model.config, "vocab_size", vocab_size) < vocab_size:
        fix = ("tokenize the data with the model's own tokenizer (data.tokenizer=<its "
               "directory>)" if path is not None else "set model.config.vocab_size")
        raise UserCodeError(f"model=hf: the model's vocabulary ({model.config.vocab_size} "
                            f"tokens) is smaller than the data's ({vocab_size}): {fix}.")
    pixels = auto_class in PIXELS
    # Padded texts: the positions holding the padding id are masked out of attention.
    return HFModel(model, "pixel_values" if pixels else "input_ids",
                   None if pixels or auto_class == "causal_lm" else pad_token_id)


def _from_config(model_class: Any, overrides: dict[str, Any]) -> nn.Module:
    transformers = _transformers()
    model_type = overrides.pop("model_type", None)
    if model_type is None:
        raise UserCodeError("model=hf: give model.path (a local directory of the model) or "
                            "model.config.model_type (gpt2, bert, vit, ...) to build one with "
                            "random weights.")
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except ValueError as e:
        raise UserCodeError(f"model.config.model_type={model_type!r}: {e}".splitlines()[0]) \
            from None
    vocab = getattr(config, "vocab_size", None)
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # GPT-2's 50256
        if vocab is not None and isinstance(getattr(config, special, None), int) \
                and getattr(config, special) >= vocab:
            setattr(config, special, None)
    return model_class.from_config(config)


def _pretrained(model_class: Any, path: Path, overrides: dict[str, Any], auto_class: str,
                sizes: dict[str, int | None]) -> nn.Module:
    """From a local directory only (local_files_only: compute nodes are offline, and the
    service never downloads). Its trained sizes are kept - the data's vocabulary is checked
    against the model's, never written over it (that would start the embeddings afresh) - but
    a classifier gets a new head where the data's classes are not the saved model's, and a
    padding id where it has none. Images of another size than the model's are refused."""
    transformers = _transformers()
    if not (path / "config.json").is_file():
        raise UserCodeError(f"model.path={path}: no such model directory (it holds no "
                            "config.json); give a directory save_pretrained wrote.")
    overrides.pop("model_type", None)
    saved = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    classes, pad = sizes["num_classes"], sizes["pad_token_id"]
    if auto_class != "causal_lm" and classes and "num_labels" not in overrides \
            and saved.num_labels != classes:
        log.info("model: %s's head has %d classes, the data %d: a new head", path,
                 saved.num_labels, classes)
        overrides["num_labels"] = classes
    if pad is not None and getattr(saved, "pad_token_id", None) is None:
        overrides.setdefault("pad_token_id", pad)
    if auto_class in PIXELS:
        for key in ("image_size", "num_channels"):
            if sizes[_SIZE_OF[key]] not in (None, getattr(saved, key, None)):
                raise UserCodeError(f"model.path={path} takes images of {key} "
                                    f"{getattr(saved, key)}, the data's are of "
                                    f"{sizes[_SIZE_OF[key]]}: set data.image_size (or give "
                                    "images of the model's size).")
    return model_class.from_pretrained(path, local_files_only=True,
                                       ignore_mismatched_sizes="num_labels" in overrides,
                                       **overrides)


_SIZE_OF = {"image_size": "image_size", "num_channels": "channels"}
