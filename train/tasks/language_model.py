"""task=language_model: next-token prediction over (tokens, next tokens) windows (data=tokens).

The loss is the cross-entropy summed over every target token, padded positions
(task.ignore_index, -100: the last partial window of an evaluated split, or a user's padding)
excluded; the service divides each optimiser step's gradient by the step's token count over all
ranks and accumulated micro-batches. Metrics: loss (per token), perplexity = exp(loss), and the
token counts `<split>/tokens` with `train/tokens_per_sec` (train/report/trainlog.py). At the end,
a few continuations of task.prompt sampled from the trained model go to `samples.txt`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train.tasks.base import Outputs, Sums, Task, model_output


class LanguageModel(Task):
    name = "language_model"
    metrics = ("loss", "perplexity")
    fixed_items = False
    items_name = "tokens"

    def __init__(self, ignore_index: int = -100, prompt: str = "\n", sample_tokens: int = 200,
                 samples_shown: int = 4) -> None:
        self.ignore_index, self.prompt = ignore_index, prompt
        self.sample_tokens, self.samples_shown = sample_tokens, samples_shown

    def step(self, output: Any, target: Any, detailed: bool = False) -> tuple[torch.Tensor, Sums]:
        logits = model_output(output)
        loss = self.loss_fn(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        with torch.no_grad():
            counted = (target != self.ignore_index).sum()
            sums: Sums = {"loss": loss.detach(), "items": counted, "samples": target.shape[0]}
        return loss, sums

    def finalize(self, sums: Mapping[str, Any]) -> dict[str, float]:
        loss = sums["loss"] / max(1, sums["items"])
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}  # exp(>709) overflows

    def output_problem(self, output: Any, target: Any, inputs: Any) -> str | None:
        logits = model_output(output)
        if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
            return (f"returns {type(logits).__name__}; task=language_model needs a tensor of "
                    "(batch, seq_len, vocab_size) next-token logits.")
        expected = (*target.shape, self.num_classes)
        if tuple(logits.shape) == expected:
            return None
        return (f"returns shape {tuple(logits.shape)} for token windows of shape "
                f"{tuple(target.shape)}; task=language_model needs (batch, seq_len, vocab_size) "
                f"= {expected} (take vocab_size in the constructor: it is filled from the data).")

    def target_problem(self, target: Any) -> str | None:
        tokens = torch.as_tensor(target)
        if tokens.ndim != 1 or tokens.is_floating_point():
            return (f"sample 0's target has shape {tuple(tokens.shape)} and dtype "
                    f"{tokens.dtype}; task=language_model reads a 1-D window of integer token "
                    "ids (the input's tokens shifted by one).")
        return None

    def outputs_per_sample(self, target_shape: tuple[int, ...], num_classes: int) -> int:
        return num_classes  # the vocabulary

    def output_card(self, target_shape: tuple[int, ...], input_shape: tuple[int, ...]
                    ) -> dict[str, Any]:
        return {"dtype": "float32", "shape": [-1, *input_shape, self.num_classes],
                "meaning": "next-token logits at every position of the input's token ids; "
                           "softmax over the last dimension"}

    def final_outputs(self, model: nn.Module, folder: Path, device: torch.device) -> Outputs:
        """task.samples_shown continuations of task.prompt, task.sample_tokens tokens each,
        sampled (temperature 1) from the trained model: `samples.txt`."""
        if self.samples_shown <= 0 or self.sample_tokens <= 0 or self.tokenizer is None:
            return [], {}
        from train.data.tokenize import tokenizer

        codec = tokenizer(self.tokenizer)
        prompt = codec.encode(self.prompt.encode()) or [0]
        idx = torch.tensor([prompt] * self.samples_shown, dtype=torch.long, device=device)
        context = int(getattr(model, "block_size", 0) or self.seq_len or len(prompt))
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for _ in range(self.sample_tokens):
                logits = model_output(model(idx[:, -context:]))[:, -1, :].float()
                idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        model.train(was_training)
        texts = [codec.decode(row[len(prompt):].tolist()) for row in idx.cpu()]
        path = folder / "samples.txt"
        rule = "\n" + "-" * 72 + "\n"
        path.write_text(f"prompt: {self.prompt!r}\n" + rule + rule.join(texts) + "\n")
        return [path], {}
