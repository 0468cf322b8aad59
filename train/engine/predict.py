"""One rank of a predicting job (`python -m train predict <run_id>`: train/launch/predict.py):
the run's model with its weights (train/engine/evaluate.py `load_run_model`), then either

- every sample of the split's strided shard through it, its rows written to this rank's part
  as they come, and rank 0 merging the parts into one Parquet file in the data set's order
  (train/engine/prediction_files.py); or
- for a language model given `predict.prompts`, each prompt's continuation (greedy, or sampled
  at `predict.temperature`) written by rank 0 as JSON lines.

The files say where they came from (run, weights, data set, split) and appear whole or not at
all; an existing `predict.out` is refused unless `predict.overwrite=true`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.distributed import phase
from train.distributed import process_group as distributed
from train.engine import evaluation, fsdp
from train.engine import prediction_files as files
from train.engine.evaluate import Loaded, load_run_model
from train.engine.prepare import Job
from train.errors import ConfigError
from train.tasks.base import model_output

log = logging.getLogger("train")
PARTS = "predict-parts"
"""Each rank's part, in the job's output directory until rank 0 merged them."""


def output_path(job: Job) -> Path:
    settings = job.cfg.predict
    if settings.out:
        return Path(settings.out).expanduser().resolve()
    return job.out / ("predictions.jsonl" if settings.prompts else "predictions.parquet")


def predict_run(job: Job) -> dict[str, float]:
    """Every rank: the run's model's outputs on the split (or the prompts' continuations)
    written to predict.out; returns predict/samples."""
    cfg, out = job.cfg, output_path(job)
    if out.exists() and not cfg.predict.overwrite:  # every rank: none starts a collective
        raise ConfigError(f"predict.out={out} exists: give another path, or "
                          "predict.overwrite=true to replace it.")
    loaded = load_run_model(job, None if cfg.predict.prompts else cfg.predict.split)
    about = {"run_id": cfg.eval.run_id, "weights": cfg.predict.weights,
             "checkpoint": cfg.eval.checkpoint, "epoch": loaded.epoch, "data": cfg.data.name,
             "split": cfg.predict.split, "world_size": job.env.world_size}
    if cfg.predict.prompts:
        written = _continue_prompts(job, loaded, out, about)
    else:
        written = _predict_split(job, loaded, out, about)
    log.info("predictions: %d %s -> %s", written,
             "prompts" if cfg.predict.prompts else "samples", out)
    return {"predict/samples": float(written)}


@torch.no_grad()
def _predict_split(job: Job, loaded: Loaded, out: Path, about: dict[str, Any]) -> int:
    env, precision = job.env, job.cfg.trainer.precision
    parts = job.out / PARTS
    if env.is_main:
        files.clear_leftovers(out, parts)
        out.parent.mkdir(parents=True, exist_ok=True)
    distributed.barrier()  # nothing of an earlier try left before anyone writes
    model, state, batches = loaded.state.module, loaded.state, loaded.batches
    assert batches is not None
    model.eval()
    fsdp.share_rank0_buffers(model)
    if state.filler is not None:  # FSDP: as many forwards on every rank
        evaluation.lockstep(model, len(batches), state.filler, job.device, precision)
    phase.enter("validation")
    part = files.Part(parts / f"rank-{env.rank:05d}.parquet")
    for inputs, target in batches:
        with evaluation.autocast(job.device, precision):
            output = evaluation.logits_of(model(inputs))
        count = len(target) if isinstance(target, torch.Tensor) else len(inputs)
        index = env.rank + (part.rows + np.arange(count)) * env.world_size
        part.add(files.rows(loaded.task.name, output, target, index,
                            loaded.bundle.class_names, out))
    part.close()
    distributed.barrier()  # every part is whole before rank 0 reads them
    written = 0
    if env.is_main:
        ranks = [parts / f"rank-{r:05d}.parquet" for r in range(env.world_size)]
        written = files.merge(ranks, out, about)
        files.clear_leftovers(out, parts)
    return int(distributed.gather_to_all(written)[0])


def _continue_prompts(job: Job, loaded: Loaded, out: Path, about: dict[str, Any]) -> int:
    """Rank 0: each prompt's continuation (FSDP: the ranks gather the weights first)."""
    cfg = job.cfg
    if loaded.bundle.vocab_size is None or loaded.bundle.tokenizer is None:
        raise ConfigError("predict.prompts needs a language model's run (data=tokens): give "
                          "the split's outputs instead (no predict.prompts).")
    model = loaded.state.module
    if fsdp.is_sharded(model):
        weights = fsdp.full_state_dict(model)[0]
        model = fsdp.plain_copy(cfg, loaded.spec, weights) if job.env.is_main else model
    if job.env.is_main:
        from train.data.tokenize import tokenizer

        codec = tokenizer(loaded.bundle.tokenizer)
        lines = [json.dumps({"prompt": prompt, "continuation": _continue(
            model.eval(), codec, prompt, loaded.bundle.input_shape[0], cfg)}) for prompt in
                 cfg.predict.prompts]
        tmp = out.with_name(out.name + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("\n".join(lines) + "\n")
        files.finish(out, about | {"prompts": len(lines),
                                   "max_new_tokens": cfg.predict.max_new_tokens,
                                   "temperature": cfg.predict.temperature})
    distributed.barrier()
    return len(cfg.predict.prompts)


@torch.no_grad()
def _continue(model: torch.nn.Module, codec: Any, prompt: str, context: int, cfg: Any) -> str:
    """`predict.max_new_tokens` tokens after `prompt`: the most likely each time, or sampled
    at predict.temperature with the job's seed (the same text for the same command)."""
    device = next(model.parameters()).device
    ids = torch.tensor([codec.encode(prompt.encode()) or [0]], dtype=torch.long, device=device)
    start, temperature = ids.shape[1], cfg.predict.temperature
    generator = torch.Generator(device=device).manual_seed(cfg.trainer.seed)
    for _ in range(cfg.predict.max_new_tokens):
        logits = model_output(model(ids[:, -context:]))[:, -1, :].float()
        if temperature == 0:
            token = logits.argmax(-1, keepdim=True)
        else:
            token = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
    return codec.decode(ids[0, start:].tolist())
