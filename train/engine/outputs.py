"""The job's files beside its outputs and in its run, written by rank 0 alone: best.pt at each
new best evaluation (trainer.save_best), and at the end model.pt, the task's pictures and tables
(train/tasks/: the confusion matrices of a classifier) and summary.json. Every rank holds a
`JobOutputs`; on the others each method does nothing, so the job script (train/engine/job.py,
prepare.py) never asks which rank it is on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from train.config.groups import TrainConfig
from train.data.build import DataBundle
from train.distributed.env import DistEnv
from train.engine import checkpoint_folder, fsdp, recompute
from train.engine import monitor as monitor_lib
from train.engine.ema import RAW_WEIGHTS
from train.engine.state import TrainState
from train.models.hf import EXPORT_DIR
from train.report.metrics import Reduced
from train.report.runlog import RunLogger
from train.tasks.base import Task

log = logging.getLogger("train")


class JobOutputs:
    def __init__(self, cfg: TrainConfig, env: DistEnv, out: Path, logger: RunLogger,
                 task: Task) -> None:
        self.cfg, self.out, self.logger, self.task = cfg, out, logger, task
        self.writes = env.is_main
        """Rank 0 is the one writer; the other ranks' outputs are no-ops."""
        self.checkpoints = checkpoint_folder.directory(out)
        self.spec: Any = None
        """The model's input spec (train/models/build.py InputSpec): what FSDP's plain copy of
        the final model is built from; set by the job once known."""

    def best_writer(self, state: TrainState) -> monitor_lib.OnBest | None:
        """The monitor's reaction to a new best evaluation: best.pt (trainer.save_best) and the
        run's best/<monitor> metric and best_epoch tag; None on the ranks that write nothing."""
        sharded = fsdp.is_sharded(state.module)
        if not self.writes and not (sharded and self.cfg.trainer.save_best):
            return None

        def on_best(best: monitor_lib.Best) -> None:
            # FSDP: every rank takes part in gathering the weights; rank 0 alone writes.
            keep = sharded and self.cfg.trainer.save_best
            weights = fsdp.full_state_dict(state.module)[0] if keep else None
            if not self.writes:
                return
            path = None
            if self.cfg.trainer.save_best:
                path = checkpoint_folder.save_best(
                    self.checkpoints, weights if sharded else state.module.state_dict(),
                    {"epoch": best.epoch + 1, "step": best.step, "monitor": best.monitor,
                     "mode": best.mode, "value": best.value})
            self.logger.training.best(best.epoch, best.monitor, best.value, path)
        return on_best

    def check_room(self, state: TrainState) -> None:
        """Before training, on the one writer: room for a checkpoint, or DiskFull now rather
        than after an epoch's work."""
        if self.writes:
            checkpoint_folder.check_room_for_one(self.checkpoints, state)

    def write_final(self, state: TrainState, bundle: DataBundle, final_val: Reduced | None,
                    peaks: list[float], tested: Reduced | None = None,
                    raw: dict[str, Any] | None = None) -> None:
        """model.pt, the task's pictures and tables of the final validation and of the test,
        summary.json; the same in the run. `raw`: trainer.ema's trained weights (model.pt
        then holds their average), written beside it as model_raw.pt. FSDP: every rank
        gathers the weights; rank 0 then works on a plain copy holding them
        (train/engine/fsdp.py), as it does for a model whose blocks recompute
        (train/engine/recompute.py)."""
        module = state.module
        if fsdp.is_sharded(module):
            weights = fsdp.full_state_dict(module)[0]
            if self.writes:
                module = fsdp.plain_copy(self.cfg, self.spec, weights)
        elif recompute.applied(module) and self.writes:  # its hooks do not pickle
            module = fsdp.plain_copy(self.cfg, self.spec, module.state_dict())
        if not self.writes:
            return
        for reduced, prefix in ((final_val, ""), (tested, "test_")):
            if reduced is not None:
                self.logger.task_outputs(*self.task.write_outputs(reduced, self.out, prefix))
        device = next(module.parameters()).device
        self.logger.task_outputs(*self.task.final_outputs(module, self.out, device))
        weights = checkpoint_folder.save_weights(module.state_dict(), self.out / "model.pt",
                                          self.checkpoints)
        files = [("weights", weights)]
        if raw is not None:
            files.append(("weights", checkpoint_folder.save_weights(
                raw, self.out / RAW_WEIGHTS, self.checkpoints)))
        if callable(getattr(module, "save_pretrained", None)) and _exportable():  # hf, gpt
            files += [(EXPORT_DIR, f) for f in _save_pretrained(module, self.out / EXPORT_DIR,
                                                                bundle.tokenizer)]
        example = _example(bundle)
        self.logger.log_outputs(files, module, example)
        (self.out / "summary.json").write_text(json.dumps(self.logger.summary(peaks), indent=2))


def _exportable() -> bool:
    """transformers is there to write the hf_model/ export (the hf extra); else said once."""
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        return True
    log.info("no hf_model/ export: transformers is not installed (pip install -e '.[hf]')")
    return False


def _save_pretrained(module: Any, folder: Path, tokenizer: str | None) -> list[Path]:
    """The model's save_pretrained directory (train/models/hf.py), with the data's tokenizer,
    whole or absent: written beside it first, then renamed over an earlier one (a resumed
    job's). Its files."""
    import shutil

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    from train.data.tokenize import PAD_TOKENS
    from train.models.gpt import GPT
    from train.models.hf import HFModel

    if isinstance(module, (HFModel, GPT)):
        module.save_pretrained(tmp, tokenizer, PAD_TOKENS)
    else:  # a transformers model of model=custom saves itself, as its users know it
        module.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return sorted(p for p in folder.iterdir() if p.is_file())


def _example(bundle: DataBundle) -> Any:
    """A few validation inputs for the logged model's signature (batch > 1: any size loads)."""
    inputs = next(iter(bundle.val))[0]
    return inputs[:4].cpu().numpy() if isinstance(inputs, torch.Tensor) else None
